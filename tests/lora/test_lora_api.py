"""The offline LoRA API (vLLM's shapes) and what it refuses.

`LoRARequest(name, int_id, path)` per prompt (`LLM.generate` / `chat` / `stream`); `enable_lora`,
`max_loras`, `max_lora_rank` engine options (and CLI flags). A missing or corrupt adapter, a rank above
max_lora_rank, targets the base lacks, an adapter for another base, DoRA, or LoRA off are ValueErrors
naming the adapter before anything runs. The engine's slot table: a request waits while every slot is
pinned by running requests' other adapters; an adapter whose files change between admission and its
load fails its request alone.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from lora_adapters import (
    ADAPTER_SPECS,
    PeftReference,
    assert_matches_reference,
    make_adapter,
    make_adapters,
    random_prompts,
    write_gguf_adapter,
)

from deepinfer import LLM, LoRARequest, SamplingParams
from deepinfer.config import LoRAConfig
from deepinfer.contracts.lora import LoRAAdapter
from deepinfer.engine.adapter_slots import AdapterSlotTable
from deepinfer.engine.prefix_cache import chain_root

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
PROMPT = list(range(200, 220))


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = make_adapters(base, root)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, block_size=8,
              max_model_len=64, num_blocks=64)
    yield base, adapters, root, llm
    llm.close()


# ---- the request object and the options --------------------------------------------------------------

def test_lora_request_has_vllms_shape():
    req = LoRARequest("sql", 3, "/adapters/sql")
    assert (req.lora_name, req.lora_int_id, req.lora_path) == ("sql", 3, "/adapters/sql")
    assert (req.name, req.adapter_id, req.path) == ("sql", 3, "/adapters/sql")
    for bad, field in ((dict(lora_int_id=0), "lora_int_id"), (dict(lora_name=""), "lora_name"),
                       (dict(lora_path=""), "lora_path")):
        with pytest.raises(ValueError, match=field):
            LoRARequest(**{"lora_name": "x", "lora_int_id": 1, "lora_path": "/p", **bad})


def test_engine_options_are_checked_and_reach_the_config():
    from deepinfer.engine_args import EngineArgs
    from deepinfer.entrypoints.cli import build_parser

    for field in ("max_loras", "max_lora_rank"):
        with pytest.raises(ValueError, match=field):
            LoRAConfig(**{field: 0})
    with pytest.raises(ValueError, match="enable_lora"):
        LoRAConfig(enable_lora="yes")
    args = build_parser().parse_args(["generate", "hi", "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32"])
    assert EngineArgs.from_cli_args(args).create_engine_config().lora == LoRAConfig(True, 3, 32)


def test_the_base_chain_root_is_unchanged_and_adapters_get_their_own():
    assert chain_root("model", None) == chain_root("model", None, None)
    roots = {chain_root("model", salt, key) for salt in (None, "t") for key in (None, "fp-a", "fp-b")}
    assert len(roots) == 6


# ---- refusals ---------------------------------------------------------------------------------------

def _refused(llm: LLM, lora: LoRARequest, *needles: str) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[None, lora], use_tqdm=False)
    message = str(info.value)
    assert message.startswith("prompts[1]: ") and lora.lora_name in message, message
    for needle in needles:
        assert needle in message, message
    assert not llm.engine.has_unfinished_requests()  # the first prompt was aborted again


def test_missing_and_corrupt_adapters_are_refused_by_name(setup, tmp_path):
    base, adapters, _, llm = setup
    _refused(llm, LoRARequest("gone", 1, str(tmp_path / "nowhere")), "no such directory")
    half = shutil.copytree(adapters["a"], tmp_path / "half")
    os.remove(half / "adapter_model.safetensors")
    _refused(llm, LoRARequest("half", 2, str(half)), "missing adapter_model.safetensors")
    bad_config = shutil.copytree(adapters["a"], tmp_path / "bad-config")
    (bad_config / "adapter_config.json").write_text("{not json")
    _refused(llm, LoRARequest("bad-config", 3, str(bad_config)), "adapter_config.json is not valid JSON")
    truncated = shutil.copytree(adapters["a"], tmp_path / "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(llm, LoRARequest("truncated", 4, str(truncated)), "not a readable safetensors file")


def test_rank_above_max_lora_rank_is_refused(setup):
    _, adapters, _, llm = setup
    _refused(llm, LoRARequest("c", 5, adapters["c"]), "rank 16", "max_lora_rank=8")


def test_targets_the_base_lacks_are_refused(setup, tmp_path):
    base, adapters, _, llm = setup
    head = make_adapter(base, str(tmp_path / "head"), r=4, targets=["lm_head"])
    _refused(llm, LoRARequest("head", 6, head), "lm_head")
    renamed = shutil.copytree(adapters["a"], tmp_path / "renamed")
    config = json.loads((renamed / "adapter_config.json").read_text())
    config["use_dora"] = True
    (renamed / "adapter_config.json").write_text(json.dumps(config))
    _refused(llm, LoRARequest("dora", 7, str(renamed)), "use_dora=True")


def test_an_adapter_for_another_base_is_refused(setup, tiny_checkpoint, tmp_path):
    _, _, _, llm = setup
    other = tiny_checkpoint("llama", hidden_size=32, intermediate_size=64)
    foreign = make_adapter(other, str(tmp_path / "foreign"), r=4, targets=["q_proj"])
    _refused(llm, LoRARequest("foreign", 8, foreign), "another base model")


def test_lora_off_and_malformed_lists_are_refused(setup):
    base, adapters, _, llm = setup
    with LLM(base, dtype="float32", max_model_len=64, num_blocks=16, block_size=8) as plain:
        _refused(plain, LoRARequest("a", 1, adapters["a"]), "enable_lora=True")
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([PROMPT, PROMPT], GREEDY, lora_request=[None], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate([PROMPT], GREEDY, lora_request="a", use_tqdm=False)


# ---- slots --------------------------------------------------------------------------------------------

def _adapter(fingerprint: str) -> LoRAAdapter:
    return LoRAAdapter(fingerprint, 1, "/p", fingerprint, fingerprint, 4)


def test_slot_table_pins_shares_content_and_evicts_the_least_recently_used():
    table = AdapterSlotTable(2)
    a, b, c = _adapter("a"), _adapter("b"), _adapter("c")
    assert table.acquire("r1", a) == 0 and table.acquire("r2", b) == 1
    assert table.acquire("r3", a) == 0  # the same content: the same slot
    assert not table.can_acquire(c)  # both pinned: c waits
    table.release("r2")
    assert table.can_acquire(c) and table.acquire("r4", c) == 1  # b's unpinned slot taken
    table.release("r1")
    table.release("r3")
    table.release("r4")
    assert table.acquire("r5", c) == 1  # still loaded there
    assert table.acquire("r6", b) == 0  # a (least recently used) evicted
    table.check()


def test_a_request_waits_for_a_slot(setup):
    """max_loras=1: the second adapter's request is not admitted while the first runs; the base
    request behind it waits too (first come, first served)."""
    _, adapters, _, llm = setup
    engine = llm.engine
    for name, lora in (("r-a", LoRARequest("a", 1, adapters["a"])), ("r-b", LoRARequest("b", 2, adapters["b"])),
                       ("r-base", None)):
        engine.add_request(PROMPT, GREEDY, name, lora_request=lora)
    engine.step()
    assert engine.get_metrics()["num_requests_running"] == 1
    assert engine.scheduler.running[0].request_id == "r-a"
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_manager.check_no_leaks()
    engine.scheduler.adapter_slots.check()


def test_an_adapter_changed_before_its_load_fails_its_request_alone(setup, tmp_path):
    base, _, _, llm = setup
    path = make_adapter(base, str(tmp_path / "moving"), **{**ADAPTER_SPECS["b"], "seed": 20})  # never loaded
    engine = llm.engine
    engine.add_request(PROMPT, GREEDY, "moving", lora_request=LoRARequest("moving", 9, path))
    engine.add_request(PROMPT, GREEDY, "plain")
    make_adapter(base, path, **{**ADAPTER_SPECS["b"], "seed": 21})  # rewritten after admission
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outs["moving"].outputs[0].finish_reason == "error" and "changed on disk" in str(outs["moving"].error)
    assert outs["plain"].outputs[0].finish_reason == "length"


# ---- chat, stream, structured output ------------------------------------------------------------------

def test_chat_stream_and_structured_output_take_an_adapter(setup):
    from deepinfer import StructuredOutputsParams

    base, adapters, _, llm = setup
    ref = PeftReference(base, {"b": adapters["b"]})
    lora = LoRARequest("b", 2, adapters["b"])
    (generated,) = llm.generate([PROMPT], GREEDY, lora_request=lora, use_tqdm=False)
    assert_matches_reference(ref, "b", PROMPT, generated.outputs[0])
    streamed = list(llm.stream(PROMPT, GREEDY, lora_request=lora))[-1]
    assert streamed.outputs[0].token_ids == generated.outputs[0].token_ids
    messages = [{"role": "user", "content": "hello"}]
    (chat,) = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora)
    assert_matches_reference(ref, "b", llm.apply_chat_template(messages), chat.outputs[0])
    choices = ["alpha", "beta", "gamma"]
    constrained = SamplingParams(max_tokens=8, temperature=0.0, structured_output=StructuredOutputsParams(
        choice=choices))
    prompts = random_prompts(2, 10, 20, seed=5)
    outs = llm.generate([prompts[0], prompts[1]], [constrained, GREEDY], lora_request=lora, use_tqdm=False)
    assert outs[0].outputs[0].text in choices
    assert_matches_reference(ref, "b", prompts[1], outs[1].outputs[0])


def test_a_gguf_adapter_is_read_through_the_gguf_reader(setup, tmp_path):
    """A llama.cpp LoRA file (q/k rows in llama.cpp's order: the base's head counts undo it) gives PEFT's
    tokens for the adapter it was written from, and shares cached prefixes only with itself."""
    base, adapters, _, llm = setup
    path = write_gguf_adapter(adapters["b"], str(tmp_path / "b.gguf"), num_heads=4, num_kv_heads=2)
    ref = PeftReference(base, {"b": adapters["b"]})
    lora = LoRARequest("b-gguf", 10, path)
    prompt = list(range(400, 420))  # computed by no other test
    outs = [llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0] for _ in range(2)]
    for out in outs:
        assert_matches_reference(ref, "b", prompt, out.outputs[0], atol=1e-4)
    assert outs[1].num_cached_tokens > 0
    (peft,) = llm.generate([prompt], GREEDY, lora_request=LoRARequest("b", 2, adapters["b"]), use_tqdm=False)
    assert peft.num_cached_tokens == 0  # the same weights in other files: another fingerprint
