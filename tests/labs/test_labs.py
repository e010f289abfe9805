"""The labs print exactly the book's blocks (tests/golden/) and save what they print."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"


def golden(name):
    return (GOLDEN / f"{name}.txt").read_text().splitlines()


def run_lab(script, *args, tmp_path, variables=None, check=True, timeout=60):
    """Run a lab from the repository root with a clean DEEPINFER_* environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(variables or {})
    out = tmp_path / "out.txt"
    result = subprocess.run([sys.executable, f"labs/{script}", *args, "--out", str(out)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, result.stderr
    return result, out


def blocks(result, out):
    """Split stdout into blank-line separated blocks; the saved file holds all but the last line."""
    lines = result.stdout.splitlines()
    assert lines[-1] == f"Saved output · {out}"
    assert out.read_text() == "\n".join(lines[:-1]) + "\n"
    text = "\n".join(lines[:-1])
    return [block.splitlines() for block in text.split("\n\n")]


def load_lab(name):
    if str(ROOT / "labs") not in sys.path:
        sys.path.insert(0, str(ROOT / "labs"))  # as when the lab runs as a script: its helpers beside it
    spec = importlib.util.spec_from_file_location(f"lab_{name}", ROOT / "labs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- lab 07 -------------------------------------------------------------------------------------

@pytest.mark.subprocess
def test_lab07_prints_the_book(tmp_path):
    result, out = run_lab("07_attention.py", tmp_path=tmp_path)
    assert blocks(result, out) == [golden("07_table"), golden("07_full"), golden("07_window3")]


@pytest.mark.subprocess
def test_lab07_window_larger_than_input_equals_full(tmp_path):
    result, out = run_lab("07_attention.py", "--window", "10", tmp_path=tmp_path)
    [block] = blocks(result, out)
    assert block[0] == "window=10: cached outputs match every recomputed prefix"
    assert block[1:] == golden("07_full")[1:]


@pytest.mark.subprocess
def test_lab07_window_one_returns_each_value_row(tmp_path):
    lab = load_lab("07_attention")
    outputs, pairs, kept = lab.incremental(lab.INPUTS, 1)
    assert outputs == [lab.project(x)[2] for x in lab.INPUTS]
    assert (pairs, kept) == (5, 1)
    result, out = run_lab("07_attention.py", "--window", "1", tmp_path=tmp_path)
    assert blocks(result, out)[0][-1] == "last output: 4.000000, -2.000000"


def test_lab07_large_window_equals_full_output_by_output():
    lab = load_lab("07_attention")
    full, _, _ = lab.incremental(lab.INPUTS, None)
    assert lab.incremental(lab.INPUTS, 99)[0] == full


def test_lab07_exits_nonzero_on_a_mismatch(tmp_path, monkeypatch, capsys):
    lab = load_lab("07_attention")
    honest = lab.incremental

    def skewed(xs, window):
        outputs, pairs, kept = honest(xs, window)
        return outputs[:-1] + [tuple(v + 1e-9 for v in outputs[-1])], pairs, kept

    monkeypatch.setattr(lab, "incremental", skewed)
    assert lab.main(["--window", "3", "--out", str(tmp_path / "out.txt")]) == 1
    captured = capsys.readouterr()
    assert "DIFFER" in captured.out and "MISMATCH prefix 5, position 4" in captured.err


@pytest.mark.subprocess
def test_lab07_refuses_window_zero(tmp_path):
    result, _ = run_lab("07_attention.py", "--window", "0", tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and "--window must be >= 1, got 0" in result.stderr


# --- lab 08 -------------------------------------------------------------------------------------

@pytest.mark.subprocess
def test_lab08_prints_the_book(tmp_path):
    result, out = run_lab("08_kv_layout.py", tmp_path=tmp_path)
    assert blocks(result, out) == [golden(name) for name in
                                   ("08_generic", "08_swa_row", "08_ring_trace", "08_overwrite")]


@pytest.mark.subprocess
def test_lab08_flags(tmp_path):
    result, out = run_lab("08_kv_layout.py", "--kv-heads", "1", "--state", "3", "--positions", "134",
                          "--rings", "128,134", tmp_path=tmp_path)
    generic, _, trace, overwrite = blocks(result, out)
    assert generic == ["generic full KV: 67,108,864 B = 64 MiB", "generic window KV: 2,097,152 B = 2 MiB"]
    assert trace[1] == "     134 |   7..134       | 409 / 402            | 402"
    assert overwrite == golden("08_overwrite")[0::2]


@pytest.mark.subprocess
def test_lab08_default_ring_follows_the_environment(tmp_path):
    result, out = run_lab("08_kv_layout.py", tmp_path=tmp_path, variables={"DEEPINFER_USE_NEXTN_DECODE": "7"})
    _, swa, trace, overwrite = blocks(result, out)
    assert swa[2] == "136 allocated rows, one layer: 71,808 B"
    assert [line.split()[0] for line in trace[1:]] == ["127", "128", "135", "136"]
    assert [line.split(":")[0] for line in overwrite] == ["S=128", "S=135", "S=136"]
    assert overwrite[0].endswith("[7, 6, 5, 4, 3, 2, 1, 0]")


@pytest.mark.subprocess
@pytest.mark.parametrize(("args", "message"), [
    (["--ring", "100"], "swa_block_size=100 is smaller than window_size=128"),
    (["--positions", "1,x"], "expected comma-separated integers"),
    (["--layers", "0"], "num_layers must be >= 1, got 0"),
])
def test_lab08_refuses_bad_flags(tmp_path, args, message):
    result, _ = run_lab("08_kv_layout.py", *args, tmp_path=tmp_path, check=False)
    assert result.returncode == 2 and message in result.stderr


# --- lab 17 -------------------------------------------------------------------------------------

@pytest.mark.subprocess
def test_lab17_worked_example(tmp_path):
    result, out = run_lab("17_kv_bytes.py", tmp_path=tmp_path)
    assert blocks(result, out) == [[
        "inputs: layers=2, kv_heads=1, head_dim=4, tokens=3, bytes=2",
        "KV payload per token (K and V, all layers): 32 B",
        "KV payload of 3 tokens: 96 B",
    ]]


@pytest.mark.subprocess
def test_lab17_flags(tmp_path):
    result, out = run_lab("17_kv_bytes.py", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                          "--tokens", "4096", "--bytes", "2", tmp_path=tmp_path)
    assert blocks(result, out)[0][-1] == "KV payload of 4,096 tokens: 536,870,912 B"


# --- lab 18 -------------------------------------------------------------------------------------

def golden_blocks(name):
    return [block.splitlines() for block in (GOLDEN / f"{name}.txt").read_text().rstrip("\n").split("\n\n")]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.real_model
def test_lab18_saved_cache_matches_golden(tmp_path):
    """The default model and the V4 mini config (small widths) save a prefix and start again: the
    formula's payload, every file in the directory and the restart's cached tokens, as in the golden."""
    result, out = run_lab("18_saved_cache.py", tmp_path=tmp_path, timeout=300)
    assert blocks(result, out) == golden_blocks("18_saved_cache")


def test_lab18_small_v4_config_keeps_the_mini_cache(tmp_path):
    """The lab's V4 config differs from configs/deepseek_v4_flash_mini only in widths that leave the
    cache alone: both build (on the meta device) the same groups, rows, rings and compressor state."""
    import json

    import torch
    from transformers import AutoConfig

    from deepinfer.environ import read_environ
    from deepinfer.model_executor.models.registry import get_model_class
    from deepinfer.worker.cache_sizing import plan_model_cache

    lab = load_lab("18_saved_cache")
    (tmp_path / "config.json").write_text(json.dumps(lab.v4_config()))
    sizings = []
    for path in (lab.V4_MINI.parent, tmp_path):
        cfg = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = get_model_class(cfg.model_type)(cfg, 4096)
        sizings.append(plan_model_cache(model, torch.float32, "fp8", 16, read_environ({}), 0)[2])
    mini, small = sizings
    assert small == mini
    assert [(g.name, g.row_bytes) for g in mini.groups] == [("swa", 528), ("csa", 528), ("hca", 528), ("index", 132)]
    assert mini.state_bytes > 0
