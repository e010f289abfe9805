"""The adaptive draft length (`spec_decode/draft_length.py`): the budget follows a request's own
acceptance and the cost of a draft pass; a request whose drafts fail stops drafting but probes;
an engine with a poor draft verifies fewer drafts for the same greedy output."""

from __future__ import annotations

import pytest
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf
from spec_helpers import run_engine

from deepinfer import LLM, SamplingParams
from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.spec_decode.draft_length import PROBE_EVERY, DraftLength, best_length, tokens_per_cost


def _verified(request_id: str, drafts: int) -> ScheduledRequest:
    """A verification span: the last sampled token and `drafts` drafts."""
    return ScheduledRequest(request_id, [1] * (1 + drafts), 10, [[0]], [], verify=True)


def test_the_best_length_follows_acceptance_and_cost():
    # n-gram drafts cost nothing to make: every draft of a sure run pays, none of a hopeless one
    assert best_length(1.0, 5, draft=0.0, row=0.15, sunk=0.0) == 5
    assert best_length(0.0, 5, draft=0.0, row=0.15, sunk=0.0) == 0
    lengths = [best_length(a / 20, 8, draft=0.45, row=0.15, sunk=0.45) for a in range(21)]
    assert lengths == sorted(lengths) and lengths[0] == 0 and lengths[-1] == 8  # more acceptance, more drafts
    # a draft as dear as the model itself never pays for a second draft, even when always right
    assert best_length(1.0, 5, draft=1.0, row=0.15, sunk=1.0) == 1
    # the pick is the argmax of tokens per cost
    a, cap = 0.8, 6
    k = best_length(a, cap, draft=0.3, row=0.1, sunk=0.3)
    assert all(tokens_per_cost(a, k, 0.3, 0.1, 0.3) >= tokens_per_cost(a, j, 0.3, 0.1, 0.3) for j in range(cap + 1))


def test_a_request_that_loses_its_drafts_stops_and_probes():
    lengths = DraftLength(adaptive=True, draft_cost=0.45, row_cost=0.15, sunk=True)
    first = lengths.budget(_verified("a", 0), [object()], 5)  # a first step: the prior drafts
    assert first > 0
    budgets, k = [], first
    for _ in range(3 * PROBE_EVERY):  # every draft rejected: one sample (the correction) a step
        k = lengths.budget(_verified("a", k), [object()], 5) if k else lengths.budget(
            ScheduledRequest("a", [1], 10, [[0]], []), [object()], 5)
        budgets.append(k)
    assert lengths.acceptance("a") < 0.1
    tail = budgets[-2 * PROBE_EVERY:]
    assert tail.count(1) == 2 and set(tail) == {0, 1}  # a single-draft probe every PROBE_EVERY steps
    # another request's history does not move this one's, nor the reverse
    assert lengths.budget(_verified("b", 0), [object()], 5) == first
    for _ in range(10):  # b's drafts all accepted: 1 + k samples a step
        k = lengths.budget(_verified("b", 5), [object()] * 6, 5)
    assert k == 5 and lengths.acceptance("b") > 0.9
    assert lengths.acceptance("a") < 0.1
    lengths.release(["a", "b"])
    assert lengths.acceptance("a") is None


def test_fixed_length_is_k():
    lengths = DraftLength(adaptive=False, draft_cost=1.0, row_cost=0.15, sunk=True)
    assert all(lengths.budget(_verified("a", 4), [object()], 4) == 4 for _ in range(20))


@pytest.mark.parametrize("field, value", [("draft_length", "sometimes"), ("row_cost", -0.1), ("row_cost", True)])
def test_bad_draft_length_options_name_the_option(field, value):
    with pytest.raises(ValueError, match=f"speculative_{field}.*{value!r}"):
        SpeculativeConfig(method="ngram", **{field: value})


def test_a_poor_draft_is_verified_less_for_the_same_output(tmp_path):
    """A random one-layer draft of a random two-layer target is rarely right: the adaptive length
    verifies fewer drafts than k every step, and the greedy output is plain decoding's."""
    cfg = tiny_hf_config("llama", num_hidden_layers=2)
    weights = random_hf_model(cfg, seed=3).state_dict()
    target = write_gguf(tmp_path / "t.gguf", "llama", cfg, weights)
    other = random_hf_model(tiny_hf_config("llama", num_hidden_layers=1), seed=4).state_dict()
    draft = write_gguf(tmp_path / "d.gguf", "llama", tiny_hf_config("llama", num_hidden_layers=1), other)
    engine = dict(block_size=4, num_blocks=64, max_model_len=96, max_num_seqs=2)
    prompts = [[5, 9, 12, 40, 33, 7], [3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = run_engine(LLM(target, **engine), prompts, params)
    drafted = {}
    for mode in ("fixed", "adaptive"):
        llm = LLM(target, speculative_model=draft, num_speculative_tokens=4, speculative_draft_length=mode, **engine)
        assert run_engine(llm, prompts, params) == plain, mode
        metrics = llm.get_metrics()
        drafted[mode] = metrics["spec_decode_num_draft_tokens"]
        rate = metrics["spec_decode_acceptance_rate"]
    assert rate < 0.5 and drafted["adaptive"] < drafted["fixed"] / 2, (drafted, rate)
