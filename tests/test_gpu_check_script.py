"""scripts/gpu_check.sh and its benchmarks: the configs have the real models' shapes, and the
whole check runs end to end on the CPU at toy sizes (`--cpu`), so it cannot fail on the GPU for a
reason a CPU run would have shown."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def _num_params(name: str) -> float:
    """Parameters of a dense config, from its widths (the model's published size is the check)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(os.path.join(ROOT, "configs", name))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * (attn + mlp) + embed


@pytest.mark.parametrize(("name", "billions"), [("qwen3_0_6b", 0.596), ("llama3_1_8b", 8.03)])
def test_dense_configs_have_the_published_size(name, billions):
    assert abs(_num_params(name) / 1e9 - billions) < 0.01 * billions


def test_v4_3l_config_is_flash_cut_to_three_layers():
    with open(os.path.join(ROOT, "configs", "deepseek_v4_flash_3l", "config.json")) as f:
        c = json.load(f)
    assert c["num_hidden_layers"] == 3 == len(c["layer_types"]) == len(c["mlp_layer_types"])
    assert c["layer_types"] == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["hidden_size"]) == (256, 6, 4096)


@pytest.mark.subprocess
def test_bench_refuses_cuda_without_a_device():
    if _cuda_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_bench.py"), "nano"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr and "--cpu" in proc.stderr


def _gpu_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", os.path.join(ROOT, "scripts", "gpu_bench.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hf_peers_produce_every_requested_token():
    """transformers' continuous batching (per-request lengths, EOS off) and the padded fallback, toy sizes."""
    bench = _gpu_bench()
    model = bench.hf_model(bench.QWEN3, cpu=True, device="cpu")
    workload = bench.nano_workload(cpu=True, vocab_size=1024)
    assert len(set(workload.output_lens)) > 1, "lengths were meant to differ per request"
    cb = bench.hf_continuous_batching(model, workload, cpu=True)
    assert (cb.engine, cb.output_tokens) == ("hf-cb", workload.num_output_tokens)
    padded = bench._hf_padded(model, workload, batch=len(workload.prompts))
    assert padded.output_tokens == workload.num_output_tokens and padded.seconds > 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_steps() -> dict[str, list[str]]:
    """{step name: the arguments after `pytest`} of each `run_step ... -m pytest ...` in gpu_check.sh
    (continuation lines joined)."""
    with open(SCRIPT) as f:
        text = f.read().replace("\\\n", " ")
    steps = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["run_step"] and "pytest" in words:
            steps[words[1]] = words[words.index("pytest") + 1:]
    return steps


MOE_TEST = "tests/ops/triton/test_moe.py::test_cuda_matches_cpu_torch_loop"


@pytest.fixture(scope="module")
def cpu_rehearsal(tmp_path_factory) -> subprocess.CompletedProcess:
    """`gpu_check.sh --cpu`, run once for the tests below (~2 minutes on 2 cores)."""
    log = tmp_path_factory.mktemp("gpu_check") / "gpu_check.log"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_LOG=str(log))
    return subprocess.run(["bash", SCRIPT, "--cpu"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)


def step_output(out: str, name: str) -> str:
    """What the gpu_check.sh step `name` printed, between its '=== name (limit' and '=== name: exit' lines."""
    start = out.index(f"=== {name} (limit ")
    return out[start:out.index(f"=== {name}: exit ", start)]


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_gpu_check_step_runs_the_compiled_moe_test(cpu_rehearsal):
    """The grouped-GEMM kernel test (CUDA-only outside the check) is selected by a gpu_check.sh step's own
    paths and marker expression, and runs there, not skipped: compiled on a GPU, interpreted as in
    `--cpu` (GPU_CHECK_CPU=1) here. Fails if the step is dropped, its `-m` stops selecting the test, or
    the test skips in the rehearsal. Read from the rehearsal's output (its step prints PASSED lines: -rA)."""
    steps = [name for name, args in pytest_steps().items()
             if any(MOE_TEST.startswith(a.rstrip("/")) for a in args if a.startswith("tests"))]
    assert steps, f"no gpu_check.sh pytest step names {MOE_TEST.split('::')[0]}"
    for name in steps:
        out = step_output(cpu_rehearsal.stdout, name)
        passed = set(re.findall(r"^PASSED (\S+)", out, re.M))
        assert f"=== {name}: exit 0 " in cpu_rehearsal.stdout, (name, out[-3000:])
        assert {f"{MOE_TEST}[1]", f"{MOE_TEST}[300]"} <= passed, (name, out[-3000:])
        assert not re.search(rf"^SKIPPED .*{re.escape(MOE_TEST.split('::')[0])}", out, re.M), (name, out[-3000:])


@pytest.mark.subprocess
@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(cpu_rehearsal):
    """`gpu_check.sh --cpu`: the CUDA tests rehearsed on the CPU pass, every benchmark prints its figures."""
    proc = cpu_rehearsal
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    summary = out[out.index("=== summary (cpu)"):]
    assert re.search(r"^\d+ passed", summary, re.M) and "failed" not in summary.split("\n")[1], summary
    for pattern in (r"nano +deepinfer +\d+ tokens .* tok/s", r"nano +hf-\S+ +\d+ tokens .* tok/s",
                    r"nano +deepinfer / hf-\S+: [\d.]+x", r"decode1 +llama3_1_8b +deepinfer +-?[\d.]+ ms/token",
                    r"decode1 +llama3_1_8b +hf ", r"decode1 +qwen3_0_6b +deepinfer ", r"decode1 +qwen3_0_6b +hf ",
                    r"v4-3l +deepinfer decode batch  1: .* ms/step", r"v4-3l +deepinfer decode batch 16: .* ms/step",
                    r"v4-3l +deepinfer prefill \d+ tokens .* tok/s", r"v4-3l +hf +decode batch 16: .* ms/step",
                    r"v4-3l +hf +prefill \d+ tokens .* tok/s"):
        assert re.search(pattern, summary), (pattern, summary)
    assert summary.rstrip().endswith("all steps passed")
