"""Tiny DeepSeek-V4 ([SLIDING, CSA, HCA], 8 routed experts) split over 2 gloo ranks gives the greedy
tokens of one rank, logprobs within 1e-4, with chunked prefill and no block leaks.

tensor_parallel_size=2 splits the attention heads; expert_parallel_size=2 gives each rank 4 of the 8
experts, expert_parallel_size=1 keeps all 8 on both ranks (rank 0 computes them). Rank 0 (this
process) reads only its slices of the split tensors and never its partner's experts. Dummy weights
are the slices of the one-rank draw; sizes that do not split are refused, naming them.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from slice_reads import spy_slice_reads

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state

sys.path.insert(0, str(Path(__file__).parents[1] / "models" / "deepseek_v4"))
from v4_tiny import CSA, HCA, SLIDING, VOCAB, make_tiny_v4  # noqa: E402

pytestmark = [pytest.mark.multirank]

PROMPT_LENGTHS, MAX_TOKENS = (3, 29, 47), 8
SPLIT_NAMES = (".wq_b.", ".wo_a.", ".wo_b.", "attn_sink")  # read as slices on every rank


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("v4tp"))
    make_tiny_v4(path, [SLIDING, CSA, HCA])
    return path


def _generate(path: str, **parallel) -> list:
    """Greedy completions of three prompts with chunked prefill (16-token steps); no block leaks."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=16, enable_prefix_caching=False, **parallel) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        engine.kv_manager.check_no_leaks()
    return [done[i] for i in ids]


def _assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for i, token in enumerate(w.token_ids):
            assert abs(g.logprobs[i][token].logprob - w.logprobs[i][token].logprob) < 1e-4


def test_two_ranks_give_one_ranks_tokens(v4_path, monkeypatch):
    want = _generate(v4_path)
    reads = spy_slice_reads(monkeypatch)
    _assert_same(_generate(v4_path, tensor_parallel_size=2, expert_parallel_size=2), want)
    assert not [n for n in reads["read"] if n.endswith(SPLIT_NAMES[:3]) or "attn_sink" in n], reads["read"]
    assert {n for n in reads["narrow"] if "attn_sink" in n or ".wq_b." in n}  # the split tensors came sliced
    experts = [n for n in reads["read"] + reads["narrow"] if ".experts." in n]
    assert experts and all(int(n.split(".experts.")[1].split(".")[0]) < 4 for n in experts), experts
    _assert_same(_generate(v4_path, tensor_parallel_size=2, expert_parallel_size=1), want)


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(r, n): this process reads tp_rank() == r of tp_size() == n (no group: construction
    and dummy weights run no collective)."""
    return lambda r, n: monkeypatch.setitem(parallel_state._WORLD, "rank", r) or \
        monkeypatch.setitem(parallel_state._WORLD, "size", n)


def _dummy_model(path: str, expert_parallel_size: int = 1):
    from deepinfer.model_executor.loader.source import load_model_source
    from deepinfer.model_executor.model_loader import build_model

    source = load_model_source(path, load_format="dummy")
    return build_model(source, torch.float32, torch.device("cpu"), 64, expert_parallel_size=expert_parallel_size)


def test_dummy_weights_are_slices_of_the_one_rank_draw(v4_path, as_rank):
    full = dict(_dummy_model(v4_path).named_parameters())
    for rank in range(2):
        as_rank(rank, 2)
        local = dict(_dummy_model(v4_path, expert_parallel_size=2).named_parameters())
        attn, moe = "model.layers.1.self_attn.", "model.layers.1.mlp."
        torch.testing.assert_close(local[attn + "q_b_proj.weight"], full[attn + "q_b_proj.weight"].chunk(2)[rank])
        torch.testing.assert_close(local[attn + "sinks"], full[attn + "sinks"].chunk(2)[rank])
        torch.testing.assert_close(local[attn + "o_a_proj.weight"], full[attn + "o_a_proj.weight"].chunk(2)[rank])
        torch.testing.assert_close(local[attn + "o_b_proj.weight"], full[attn + "o_b_proj.weight"].chunk(2, 1)[rank])
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            torch.testing.assert_close(local[moe + name], full[moe + name].chunk(2)[rank])
        for name in (attn + "kv_proj.weight", moe + "shared_experts.down_proj.weight", "lm_head.weight"):
            torch.testing.assert_close(local[name], full[name])  # held whole


def test_bad_sizes_are_refused_naming_them(v4_path, tiny_checkpoint, as_rank):
    from deepinfer.model_executor.layers.parallel_linear import check_expert_split
    from deepinfer.model_executor.models.deepseek_v4.attn import check_head_split

    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        check_head_split(4, 2, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide o_groups=2"):
        check_head_split(4, 2, 4)
    as_rank(0, 4)
    with pytest.raises(ValueError, match="n_routed_experts=6 is not divisible by expert_parallel_size=4"):
        check_expert_split(6, 4)
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide tensor_parallel_size=4"):
        check_expert_split(6, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 must divide o_groups=2"):
        _dummy_model(v4_path)
    as_rank(0, 2)
    with pytest.raises(ValueError, match="expert_parallel_size=2 needs a model with routed experts"):
        _dummy_model(tiny_checkpoint("llama"), expert_parallel_size=2)


def test_drafts_verified_on_two_ranks_give_one_ranks_tokens(v4_path):
    """Drafts accepted and rejected over 2 ranks (scripted from the plain run's tokens, some
    corrupted): every rank's compressors forget the rejected ones (rank 0 sends the step's tokens),
    so the greedy tokens are one rank's without drafting."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "spec_decode"))
    from spec_helpers import ScriptedDrafter, mixed

    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (21, 13, 9)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = dict(dtype="float32", block_size=2, num_blocks=48, max_num_seqs=3, max_num_batched_tokens=16,
                  max_model_len=75, enable_prefix_caching=False)
    with LLM(v4_path, **engine) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(v4_path, tensor_parallel_size=2, speculative_method="ngram", num_speculative_tokens=3,
             **engine) as split:
        truth = {tuple(p): list(t) for p, t in zip(prompts, want, strict=True)}
        split.engine.runner.driver.steps.drafter = ScriptedDrafter(truth, 3, VOCAB, mixed)  # rank 0 drafts
        got = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
        metrics = split.get_metrics()
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics["spec_decode_num_draft_tokens"]
    assert got == want


def test_mtp_drafting_on_two_ranks_gives_one_ranks_drafts_and_tokens(v4_path):
    """The MTP module split like the main layers (dummy weights: the one-rank draw's slices): every
    rank runs its passes after each step (rank 0 sends the sampled tokens), and the drafts, the
    acceptance counts and the tokens are one rank's."""
    rng = random.Random(6)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (21, 13, 9)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = dict(dtype="float32", block_size=2, num_blocks=48, max_num_seqs=3, max_num_batched_tokens=16,
                  max_model_len=75, enable_prefix_caching=False, load_format="dummy", speculative_method="mtp",
                  num_speculative_tokens=3)
    runs = []
    for ranks in ({}, {"tensor_parallel_size": 2, "expert_parallel_size": 2}):
        with LLM(v4_path, **engine, **ranks) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            metrics = llm.get_metrics()
        runs.append(([o.outputs[0].token_ids for o in outs], metrics["spec_decode_num_draft_tokens"],
                      metrics["spec_decode_num_accepted_tokens"]))
    assert runs[1] == runs[0] and runs[0][1] > 0
