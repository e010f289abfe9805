"""The scheduler's side of speculative decoding: drafts become one verification span cut to
what max_tokens, the model length and the budget allow; the step's samples advance the request
by their count, stop token by token, and give back blocks only rejected positions used."""

from __future__ import annotations

from deepinfer.config import SchedulerConfig
from deepinfer.contracts.plan import ModelOutput, SampleResult
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec
from deepinfer.engine.request import Request
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams


def _scheduler(budget: int = 64, max_model_len: int = 64, num_blocks: int = 32) -> Scheduler:
    kv = KVCacheManager((PagedGroupSpec("full", 4),), num_blocks=num_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv, max_model_len)


def _samples(*ids: int) -> list[SampleResult]:
    return [SampleResult(t, -1.0) for t in ids]


def _decoding(sched: Scheduler, prompt_len: int = 6, max_tokens: int = 20, drafts=(50, 51, 52, 53, 54),
              eos: frozenset = frozenset(), stop=()) -> Request:
    """A request past its prefill (first token 40 sampled) holding `drafts`."""
    req = Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop)),
                  eos_token_ids=eos)
    sched.add_request(req)
    plan = sched.schedule()
    sched.update(plan, ModelOutput({"r": _samples(40)}, draft_token_ids={"r": list(drafts)}))
    return req


def test_drafts_become_one_verification_span():
    sched = _scheduler()
    req = _decoding(sched)
    (s,) = sched.schedule().scheduled
    assert s.verify and s.token_ids == [40, 50, 51, 52, 53, 54] and s.start_pos == 6
    assert s.draft_token_ids == [50, 51, 52, 53, 54] and s.do_sample
    assert req.draft_token_ids == [50, 51, 52, 53, 54]  # kept until the step's results come back


def test_the_span_is_cut_by_max_tokens_model_length_and_budget():
    sched = _scheduler()
    _decoding(sched, max_tokens=4)  # 1 output so far: 3 more at most, one of them the target's own
    assert sched.schedule().scheduled[0].token_ids == [40, 50, 51]
    sched = _scheduler(max_model_len=10)  # 7 tokens: 3 more fit, one of them the target's own
    _decoding(sched)
    assert sched.schedule().scheduled[0].token_ids == [40, 50, 51]
    sched = _scheduler()
    _decoding(sched)
    sched.config.max_num_batched_tokens = 3
    assert sched.schedule().scheduled[0].token_ids == [40, 50, 51]
    sched = _scheduler()
    _decoding(sched, max_tokens=2)  # room for the target's token only: a plain decode
    (s,) = sched.schedule().scheduled
    assert s.token_ids == [40] and not s.verify


def test_samples_advance_the_request_and_rejected_blocks_are_freed():
    sched = _scheduler()
    req = _decoding(sched, prompt_len=7)
    plan = sched.schedule()  # positions 7..12: blocks for 13 tokens (4 blocks of 4)
    assert len(sched.kv_manager.block_ids("r")[0]) == 4
    sched.update(plan, ModelOutput({"r": _samples(50, 99)}, draft_token_ids={"r": [7, 8]}))
    assert req.output_token_ids == [40, 50, 99] and req.num_computed_tokens == 9  # 40 and 50 computed
    assert len(sched.kv_manager.block_ids("r")[0]) == 3  # positions 0..8
    assert req.draft_token_ids == [7, 8]
    assert sched.spec_stats.num_draft_tokens == 5 and sched.spec_stats.num_accepted_tokens == 1
    sched.kv_manager.check_consistency()


def test_a_stop_inside_the_run_ends_it_there():
    sched = _scheduler()
    req = _decoding(sched, stop=(51,))
    plan = sched.schedule()
    out = ModelOutput({"r": _samples(50, 51, 52, 53)})
    [update] = sched.update(plan, out)
    assert req.is_finished and req.stop_reason == 51 and req.output_token_ids == [40, 50, 51]
    assert update.request is req and [r.token_id for r in update.samples] == [50, 51]  # kept: for output processing
    assert [r.token_id for r in out.samples["r"]] == [50, 51, 52, 53]  # the model output is left as it was
    sched.kv_manager.check_no_leaks()
    sched = _scheduler()
    req = _decoding(sched, max_tokens=3)
    plan = sched.schedule()
    sched.update(plan, ModelOutput({"r": _samples(50, 51)}))
    assert req.is_finished and req.output_token_ids == [40, 50, 51] and req.status.finish_reason == "length"
