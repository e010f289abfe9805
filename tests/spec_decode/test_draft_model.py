"""Draft-model speculation (`speculative_model`): a second, smaller checkpoint with the target's
tokenizer drafts; the target verifies. Greedy output equals plain decoding token for token, with
chunked prefill, a batch, prefix hits (in memory, from snapshots of ring models, from a saved cache
directory) and preemption; a draft that is a copy of the target has every draft accepted, so the
same output takes fewer engine steps; a draft with another tokenizer is refused."""

from __future__ import annotations

import pytest
import torch
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf
from spec_helpers import run_engine

from deepinfer import LLM, LoRARequest, SamplingParams
from deepinfer.config import SpeculativeConfig
from deepinfer.engine_args import EngineArgs
from deepinfer.entrypoints.cli import build_parser

K = 3
# chunked prefill (8 tokens a step), small blocks, a pool too small for four long requests at once
ENGINE = dict(block_size=4, num_blocks=16, max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64)
PROMPTS = [[5, 9, 12, 40, 33, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20] * 5, [61, 2, 17, 17, 50, 8, 8, 30, 31]]


def _greedy(max_tokens: int = 30) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """GGUF files of tiny random models, one tokenizer: a 2-layer Llama target and its first layer
    as a draft; a Gemma 3 target (sliding and global layers) and its first two (sliding) layers;
    a Llama with a larger vocabulary (another tokenizer)."""
    d = tmp_path_factory.mktemp("draft-model")
    paths = {}
    for arch, layers, keep in (("llama", 2, 1), ("gemma3", 7, 2)):
        cfg = tiny_hf_config(arch, num_hidden_layers=layers)
        weights = random_hf_model(cfg, seed=1).state_dict()
        paths[arch] = write_gguf(d / f"{arch}.gguf", arch, cfg, weights)
        short = {k: v for k, v in weights.items() if ".layers." not in k or int(k.split(".")[2]) < keep}
        paths[arch + "-draft"] = write_gguf(d / f"{arch}-draft.gguf", arch,
                                            tiny_hf_config(arch, num_hidden_layers=keep), short)
    cfg = tiny_hf_config("llama", vocab_size=80)
    paths["other-vocab"] = write_gguf(d / "other.gguf", "llama", cfg, random_hf_model(cfg).state_dict())
    return paths


def _steps(llm: LLM, prompts, params: SamplingParams, on_step=None) -> tuple[dict[int, list[int]], int]:
    """Outputs by prompt index and the engine steps they took."""
    steps = []

    def count(engine) -> None:
        steps.append(1)
        if on_step is not None:
            on_step(engine)
    return run_engine(llm, prompts, params, on_step=count), len(steps)


def _same_rows(engine, compared: list[int]) -> None:
    """With a copy of the target as the draft: at every running request's computed positions the
    draft's rows equal the target's, byte for byte, at the same units (ring rows of the window
    before the next position, paged rows of every position). Appends the rows compared."""
    runner, kv = engine.runner, engine.kv_manager
    draft, names = runner.caches.draft, [g.name for g in runner.groups]
    for req in engine.scheduler.running:
        done, blocks, slots = req.num_computed_tokens, kv.block_ids(req.request_id), kv.state_ids(req.request_id)
        for gi, g in enumerate(draft.groups):
            ti, unit = names.index(draft.plan.mirrors[gi]), draft.plan.unit_index[gi]
            rows = g.rows_per_unit
            assert runner.groups[ti].rows_per_unit == rows and runner.groups[ti].layer_ids == g.layer_ids
            positions = range(max(0, done - g.window), done) if g.is_ring else range(done)
            units = [slots[unit] if g.is_ring else blocks[unit][p // rows] for p in positions]
            at = (torch.tensor(units, dtype=torch.long), torch.tensor([p % rows for p in positions], dtype=torch.long))
            for li in range(len(g.layer_ids)):
                target = runner.caches.cache.layer_view(ti, li)[at]  # [n, 1, row]
                mine = draft.cache.layer_view(gi, li)[at]  # [n, 1, row]
                assert torch.equal(target, mine), (req.request_id, g.name, li, done)
            compared.append(len(positions))


def _spec(metrics: dict) -> tuple[int, int]:
    return metrics["spec_decode_num_accepted_tokens"], metrics["spec_decode_num_draft_tokens"]


def test_copy_of_the_target_drafts_everything_right_in_fewer_steps(checkpoints):
    # room for 4 x (1 + K) tokens a step, and blocks for all four requests (no recomputation)
    target, engine = checkpoints["llama"], dict(ENGINE, max_num_batched_tokens=16, num_blocks=64)
    plain, plain_steps = _steps(LLM(target, **engine), PROMPTS, _greedy())
    llm = LLM(target, speculative_model=target, num_speculative_tokens=K, speculative_draft_length="fixed", **engine)
    compared = []
    spec, spec_steps = _steps(llm, PROMPTS, _greedy(), on_step=lambda e: _same_rows(e, compared))
    assert spec == plain and len(spec) == len(PROMPTS) and sum(compared) > 100
    metrics = llm.get_metrics()
    accepted, drafted = _spec(metrics)
    assert metrics["speculative_method"] == "draft_model"
    assert drafted > 0 and accepted == drafted and metrics["spec_decode_acceptance_rate"] == 1.0
    assert spec_steps < plain_steps / 2, (spec_steps, plain_steps)
    # pass 0 starts where the chained rows end: the draft computes each kept position about once
    positions = sum(map(len, PROMPTS)) + sum(map(len, spec.values()))
    drafter = llm.engine.runner.steps.drafter
    assert drafter.num_tokens < 1.25 * positions, (drafter.num_tokens, positions)


def test_first_layer_draft_keeps_greedy_output(checkpoints):
    """A shallower draft is right only sometimes: steps keep all, some or none of their drafts."""
    target = checkpoints["llama"]
    plain = run_engine(LLM(target, **ENGINE), PROMPTS, _greedy(), abort=1)
    llm = LLM(target, speculative_model=checkpoints["llama-draft"], num_speculative_tokens=K, **ENGINE)
    assert run_engine(llm, PROMPTS, _greedy(), abort=1) == plain
    metrics = llm.get_metrics()
    accepted, drafted = _spec(metrics)
    assert 0 < accepted < drafted and metrics["num_preemptions"] > 0


def test_prefix_hits_find_the_drafts_rows(checkpoints):
    """A second round of prompts that share a 20-token prefix with the first: the hit's blocks
    hold the draft's rows too (a copy of the target still drafts everything right)."""
    target = checkpoints["llama"]
    prefix = [7, 3, 11, 40, 2, 9, 13, 21, 30, 5] * 2
    first, second = [prefix + [1, 4]], [prefix + [8], prefix + [6, 6, 6]]
    llm = LLM(target, speculative_model=target, num_speculative_tokens=K, **ENGINE)
    plain, compared = LLM(target, **ENGINE), []
    for prompts in (first, second):
        assert run_engine(llm, prompts, _greedy(20), on_step=lambda e: _same_rows(e, compared)) == \
            run_engine(plain, prompts, _greedy(20))
    assert sum(compared) > 100
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] >= 2 * 16
    accepted, drafted = _spec(metrics)
    assert drafted > 0 and accepted == drafted


@pytest.mark.parametrize("draft", ["gemma3", "gemma3-draft"])
def test_ring_model_with_snapshots(checkpoints, draft):
    """Gemma 3 (window 16): the draft's sliding layers keep rings at the target's state slots,
    prefix hits restore them from snapshots (taken every 4 tokens) with the target's."""
    target = checkpoints["gemma3"]
    engine = dict(ENGINE, prefix_snapshot_interval=4)
    prefix = [9, 14, 3, 3, 27, 40, 11, 5, 6, 50, 12, 8, 19, 2, 33, 44, 7, 1, 26]
    rounds = [[prefix + [4, 4]], [prefix + [30], prefix + [17, 18, 19]]]
    llm = LLM(target, speculative_model=checkpoints[draft], num_speculative_tokens=K, **engine)
    groups = {g.name: g for g in llm.engine.runner.caches.draft.groups}
    assert "draft-swa" in groups and groups["draft-swa"].rows_per_unit >= 16 + K + 1
    plain, compared = LLM(target, **engine), []
    check = (lambda e: _same_rows(e, compared)) if draft == "gemma3" else None
    for prompts in rounds:
        assert run_engine(llm, prompts, _greedy(40), on_step=check) == run_engine(plain, prompts, _greedy(40))
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] >= 2 * 16 and metrics["prefix_cache_snapshots"] > 0
    accepted, drafted = _spec(metrics)
    assert drafted > 0
    if draft == "gemma3":  # a copy: every draft right, every row equal to the target's
        assert accepted == drafted and sum(compared) > 100


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_saved_cache_directory_holds_the_drafts_rows(checkpoints, tmp_path, arch):
    """Blocks (and, for Gemma 3's rings, snapshots) read back from --kv-cache-dir by a new engine
    carry the draft's rows."""
    target = checkpoints[arch]
    prompt = [[7, 3, 11, 40, 2, 9, 13, 21, 30, 5, 8, 8, 1, 2, 3, 4, 60]]
    engine = dict(ENGINE, speculative_model=target, num_speculative_tokens=K, kv_cache_dir=str(tmp_path),
                  prefix_snapshot_interval=8)
    first = LLM(target, **engine)
    expected = run_engine(first, prompt, _greedy(12))
    first.engine.runner.close()
    again, compared = LLM(target, **engine), []
    assert run_engine(again, prompt, _greedy(12), on_step=lambda e: _same_rows(e, compared)) == expected
    metrics = again.get_metrics()
    assert metrics["kv_cache_dir_files_read"] > 0 and metrics["prefix_cache_disk_hits"] >= 16 and sum(compared)
    accepted, drafted = _spec(metrics)
    assert drafted > 0 and accepted == drafted


def test_sizing_counts_the_drafts_rows(checkpoints):
    """Each block and state slot holds the draft's rows beside the target's: the page the sizing
    divides memory by is both, and the draft has no blocks of its own."""
    target = checkpoints["llama"]
    plain = LLM(target, **ENGINE).engine.runner.caches.sizing
    with_draft = LLM(target, speculative_model=checkpoints["llama-draft"], **ENGINE).engine.runner.caches.sizing
    draft = [g for g in with_draft.groups if g.mirrors == "full"]
    assert [g.name for g in draft] == ["draft"] and draft[0].num_layers == 1
    assert with_draft.page_bytes == plain.page_bytes * 3 // 2  # 2 target layers + 1 draft layer per block
    assert with_draft.blocks_for(40) == plain.blocks_for(40)
    assert with_draft.per_token == plain.per_token * 3 / 2


def test_sampled_requests_run_with_a_draft(checkpoints):
    """Temperature > 0: drafts are verified by the rejection sampler (one-hot q); a copy of the
    target is right only where the target's draw is its argmax, so steps keep some drafts and
    trim the blocks of the rest, and the draft's rows still follow the target's. A seeded request
    draws the same tokens twice."""
    target = checkpoints["llama"]
    llm, compared = LLM(target, speculative_model=target, num_speculative_tokens=K, **ENGINE), []
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True)
    first, second = (run_engine(llm, PROMPTS[:2], params, on_step=lambda e: _same_rows(e, compared))
                     for _ in range(2))
    assert first == second and all(len(t) == 20 for t in first.values()) and sum(compared) > 50
    accepted, drafted = _spec(llm.get_metrics())
    assert 0 < accepted < drafted


def test_lora_requests_verify_the_base_drafts(tiny_checkpoint, tmp_path):
    """The adapter applies to the target alone: drafts come from the base draft, output is the
    adapted model's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = tiny_checkpoint("llama", vocab_size=1024)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(
        r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.05)
    peft.save_pretrained(tmp_path / "adapter")
    lora, engine = LoRARequest("a", 1, str(tmp_path / "adapter")), dict(ENGINE, enable_lora=True, max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]

    def tokens(llm: LLM, adapter) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(16), lora_request=adapter,
                                                              use_tqdm=False)]
    plain = LLM(base, **engine)
    llm = LLM(base, speculative_model=base, num_speculative_tokens=K, **engine)
    assert tokens(llm, lora) == tokens(plain, lora) != tokens(plain, None)
    accepted, drafted = _spec(llm.get_metrics())
    assert 0 < accepted < drafted


def test_draft_rings_need_target_rings(tiny_checkpoint):
    """A sliding-window draft has no state slots to share with a full-attention target."""
    target, draft = tiny_checkpoint("llama", vocab_size=1024), tiny_checkpoint("mistral_swa", vocab_size=1024)
    with pytest.raises(ValueError, match="speculative_model: the draft's 'swa' layers need the target to have a "
                                         "sliding-window"):
        LLM(target, speculative_model=draft, **ENGINE)


def test_another_tokenizer_is_refused(checkpoints):
    with pytest.raises(ValueError, match="speculative_model=.*other.gguf.*vocabulary size 81 vs the target.s 65"):
        LLM(checkpoints["llama"], speculative_model=checkpoints["other-vocab"], **ENGINE)


def test_options():
    assert SpeculativeConfig(model="d.gguf").method == "draft_model"
    for command in (["serve"], ["generate", "hi"], ["chat"]):  # every command's engine flags take it
        args = build_parser().parse_args([*command, "--speculative-model", "d.gguf"])
        assert EngineArgs.from_cli_args(args).speculative_model == "d.gguf"
    config = EngineArgs(model="m", speculative_model="d.gguf", num_speculative_tokens=2).create_engine_config()
    assert (config.speculative.method, config.speculative.model) == ("draft_model", "d.gguf")
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="speculative_model='d.gguf'.*'ngram'"):
        SpeculativeConfig(method="ngram", model="d.gguf")
    with pytest.raises(ValueError, match="speculative_model must be a path"):
        SpeculativeConfig(model="")
