"""The one chain loop of the model drafters (`spec_decode/chain.py`): its passes, budgets and next
spans on a scripted drafter; MTP and the draft model are two `ChainDrafter`s that write no loop of
their own, and in real engines every drafting step of both goes through `run_chains`."""

from __future__ import annotations

import os
import sys
from typing import Any

from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.drafting import Drafter
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.spec_decode import chain
from deepinfer.spec_decode.chain import Chain, ChainDrafter, run_chains
from deepinfer.spec_decode.draft_model import DraftModelDrafter
from deepinfer.spec_decode.drafter import NgramDrafter
from deepinfer.spec_decode.mtp import MtpDrafter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models", "deepseek_v4"))
from v4_tiny import CSA, SLIDING, make_tiny_v4  # noqa: E402

K = 3


class _Scripted(ChainDrafter):
    """Drafts token 100 * step + position; records each pass's spans and what each chain carried."""

    def __init__(self, chains: list[Chain]):
        self.chains, self.passes = chains, []

    def first_pass(self, inputs, samples):
        return self.chains, {}

    def run_pass(self, step: int, chains: list[Chain], wanted: list[Chain]) -> list[tuple[int, Any]]:
        self.passes.append([(c.sched.request_id, c.sched.start_pos, c.sched.token_ids, c.carry) for c in chains])
        return [(100 * step + c.last_pos, f"{c.sched.request_id}@{step}") for c in wanted]


def _chain(rid: str, tokens: list[int], start: int, budget: int) -> Chain:
    return Chain(ScheduledRequest(rid, tokens, start, ([7],), (2,)), budget, [], carry="pass0")


def test_passes_follow_the_budgets_and_chain_each_draft_at_the_next_position():
    chains = [_chain("prefill", [1, 2, 3], 0, 0), _chain("one", [4], 9, 1), _chain("three", [5, 6], 20, 3)]
    drafter = _Scripted(chains)
    assert run_chains(drafter, chains) == 3
    assert [[rid for rid, *_ in p] for p in drafter.passes] == [["prefill", "one", "three"], ["three"], ["three"]]
    # pass j's span is the chain's last draft at the position after the previous span's end
    assert drafter.passes[1] == [("three", 22, [21], "three@0")]
    assert drafter.passes[2] == [("three", 23, [122], "three@1")]
    assert [c.drafts for c in chains] == [[], [9], [21, 122, 223]]
    assert all(c.sched.block_ids == ([7],) and c.sched.state_ids == (2,) for c in chains)


def test_both_model_drafters_are_chain_drafters_without_a_loop_of_their_own():
    for cls in (MtpDrafter, DraftModelDrafter):
        assert issubclass(cls, ChainDrafter) and "propose" not in vars(cls), cls
        assert cls.runs_model is True
    assert not issubclass(NgramDrafter, ChainDrafter) and NgramDrafter.runs_model is False
    for cls in (NgramDrafter, MtpDrafter, DraftModelDrafter):  # the Drafter protocol's members
        assert all(callable(getattr(cls, name)) for name in ("propose", "draft_probs", "release")), cls
    assert {"propose", "draft_probs", "release", "runs_model"} <= set(Drafter.__annotations__) | set(vars(Drafter))


def _count_chains(monkeypatch) -> list[tuple[str, int]]:
    """Every `run_chains` call from now on: (the drafter's class, passes run)."""
    calls, real = [], chain.run_chains

    def counted(drafter, chains):
        calls.append((type(drafter).__name__, real(drafter, chains)))
        return calls[-1][1]

    monkeypatch.setattr(chain, "run_chains", counted)
    return calls


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_mtp_and_the_draft_model_draft_through_the_same_loop(monkeypatch, tmp_path):
    """One engine drafting with DeepSeek-V4's MTP module and one with a draft checkpoint: each step
    of each runs `run_chains` once, whose passes reach k for a request with room."""
    calls = _count_chains(monkeypatch)
    v4 = str(tmp_path / "v4")
    make_tiny_v4(v4, [SLIDING, CSA])
    engine = dict(block_size=2, num_blocks=48, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    mtp = LLM(v4, load_format="dummy", speculative_method="mtp", num_speculative_tokens=K,
              speculative_draft_length="fixed", **engine)
    mtp.generate([[5, 9, 12, 40, 33, 7, 8]], _greedy(12), use_tqdm=False)
    mtp_calls = [passes for name, passes in calls if name == "MtpDrafter"]
    assert len(mtp_calls) == len(calls) > 1 and max(mtp_calls) == K

    cfg = tiny_hf_config("llama", num_hidden_layers=2)
    weights = random_hf_model(cfg, seed=1).state_dict()
    target = write_gguf(tmp_path / "llama.gguf", "llama", cfg, weights)
    short = {k: v for k, v in weights.items() if ".layers." not in k or int(k.split(".")[2]) < 1}
    draft = write_gguf(tmp_path / "draft.gguf", "llama", tiny_hf_config("llama", num_hidden_layers=1), short)
    calls.clear()
    llm = LLM(target, speculative_model=draft, num_speculative_tokens=K, speculative_draft_length="fixed", block_size=4,
              num_blocks=32, max_model_len=64)
    llm.generate([[3, 4, 5, 6, 7, 8]], _greedy(12), use_tqdm=False)
    draft_calls = [passes for name, passes in calls if name == "DraftModelDrafter"]
    assert len(draft_calls) == len(calls) > 1 and max(draft_calls) == K
    assert llm.engine.runner.steps.drafter.num_passes == sum(draft_calls)  # every draft forward was a loop pass
