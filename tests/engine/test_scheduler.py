"""Scheduler: token budget, chunked prefill, FCFS, preemption by recompute, aborts, stops.

A fake runner stands in for the model. It keeps a physical KV cache: it writes each scheduled
token into the row its block table names, reads the whole context back through the block table
when it samples, and picks the next token as a hash of (request id, context). A plan with wrong
positions, tokens or block tables therefore changes the generated tokens or trips a check, and
the tokens must equal `reference_output`, which runs each request alone without a cache.
"""

import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer.config import SchedulerConfig
from deepinfer.contracts.plan import ModelOutput, SampleResult, StepPlan
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec, RingGroupSpec
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams

RUNNING, PREEMPTED, ABORTED = RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.FINISHED_ABORTED


def next_token(request_id: str, context: list[int]) -> int:
    """The fake model: a deterministic token in [100, 1100) from the request and its context."""
    return 100 + zlib.crc32(f"{request_id}|{context}".encode()) % 1000


def make_prompt(request_id: str, num_tokens: int) -> list[int]:
    return [(zlib.crc32(request_id.encode()) + 7 * i) % 97 for i in range(num_tokens)]


def reference_output(req: Request, max_model_len: int) -> list[int]:
    """What the request generates when it runs alone, token by token."""
    params, context, outputs = req.sampling_params, list(req.prompt_token_ids), []
    while True:
        token_id = next_token(req.request_id, context)
        outputs.append(token_id)
        context.append(token_id)
        if (token_id in params.stop_token_ids or (not params.ignore_eos and token_id in req.eos_token_ids)
                or len(outputs) >= params.max_tokens or len(context) >= max_model_len):
            return outputs


class FakeRunner:
    """Writes tokens into rows through the block table; samples from what it reads back."""

    def __init__(self, block_size: int, forced: dict[str, list[int]] | None = None):
        self.block_size = block_size
        self.forced = forced or {}  # request id -> output tokens to emit instead of the hash
        self.rows: dict[int, tuple[str, int, int]] = {}  # slot -> (request id, position, token)
        self.num_computed: dict[str, int] = {}  # positions written since the request (re)started

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> ModelOutput:
        for rid in plan.finished_request_ids + plan.preempted_request_ids:
            self.num_computed.pop(rid, None)
        for s in plan.scheduled:
            assert s.start_pos == self.num_computed.get(s.request_id, 0), "positions skipped"
            for pos, token_id in enumerate(s.token_ids, start=s.start_pos):
                self.rows[self.slot(s.block_ids[0], pos)] = (s.request_id, pos, token_id)
            self.num_computed[s.request_id] = s.start_pos + s.num_tokens
        return ModelOutput({s.request_id: [SampleResult(self.sample(s), -1.0)]
                            for s in plan.scheduled if s.do_sample})

    def sample(self, s) -> int:
        end = s.start_pos + s.num_tokens
        context = []
        for pos in range(end):
            rid, row_pos, token_id = self.rows[self.slot(s.block_ids[0], pos)]
            assert (rid, row_pos) == (s.request_id, pos), f"row of {s.request_id}@{pos} overwritten"
            context.append(token_id)
        forced, num_outputs = self.forced.get(s.request_id, []), end - len(s.prompt_token_ids)
        return forced[num_outputs] if num_outputs < len(forced) else next_token(s.request_id, context)


class Harness:
    """A scheduler, its KV manager and a fake runner; every plan is checked as it is made."""

    def __init__(self, block_size=4, num_blocks=64, budget=32, max_num_seqs=8, max_model_len=256,
                 forced=None, num_state_slots=0):
        specs = (PagedGroupSpec("full", block_size),)
        if num_state_slots:
            specs += (RingGroupSpec("swa", 8),)
        self.kv = KVCacheManager(specs, num_blocks, num_state_slots)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget), self.kv, max_model_len)
        self.runner = FakeRunner(block_size, forced)
        self.order: dict[str, int] = {}  # request id -> arrival index
        self.done: dict[str, Request] = {}  # finished or aborted
        self.num_steps = 0

    def add(self, rid, num_prompt=4, eos=(), max_model_len=None, **params) -> Request:
        req = Request(rid, make_prompt(rid, num_prompt), SamplingParams(**params),
                      eos_token_ids=frozenset(eos), max_model_len=max_model_len)
        self.sched.add_request(req)
        self.order[rid] = len(self.order)
        return req

    def abort(self, rid) -> bool:
        req = self.sched.get_request(rid)
        aborted = self.sched.abort_request(rid)
        if aborted:
            self.done[rid] = req
        return aborted

    def step(self) -> tuple[StepPlan, list[Request]]:
        plan = self.sched.schedule()
        check_plan(self, plan)
        updated = [u.request for u in self.sched.update(plan, self.runner.execute(plan))]
        self.done.update((r.request_id, r) for r in updated if r.is_finished)
        self.num_steps += 1
        return plan, updated

    def run(self, max_steps=20_000) -> None:
        while self.sched.has_unfinished_requests():
            assert self.num_steps < max_steps, "no progress"
            self.step()
        self.kv.check_no_leaks()


def check_plan(h: Harness, plan: StepPlan) -> None:
    """Invariants of every plan and of the scheduler state right after schedule()."""
    sched, kv, cfg = h.sched, h.kv, h.sched.config
    assert not plan.is_empty or not sched.has_unfinished_requests(), "unfinished requests but idle"
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    assert sched.num_running <= cfg.max_num_seqs
    assert len({s.request_id for s in plan.scheduled}) == len(plan.scheduled)
    for s in plan.scheduled:
        req = sched.get_request(s.request_id)
        assert s.request_id not in h.done and req is not None and req.status is RUNNING
        end = s.start_pos + s.num_tokens
        assert s.num_tokens >= 1 and s.start_pos == req.num_computed_tokens
        assert s.token_ids == req.token_ids[s.start_pos:end]
        assert s.do_sample == (end == req.num_tokens)
        assert s.prompt_token_ids is req.prompt_token_ids and s.output_token_ids is req.output_token_ids
        assert len(s.block_ids[0]) == kv.paged_specs[0].num_blocks_for(end)
        assert s.state_ids == kv.state_ids(s.request_id)
    for req in sched.running:
        num_blocks_needed = kv.paged_specs[0].num_blocks_for(req.num_computed_tokens)
        assert len(kv.block_ids(req.request_id)[0]) >= num_blocks_needed
    held = [b for req in sched.running for b in kv.block_ids(req.request_id)[0]]
    assert len(held) == len(set(held)), "a block is held by two requests"
    assert kv.num_allocated_requests == sched.num_running
    assert all(r.status in (RequestStatus.WAITING, PREEMPTED) for r in sched.waiting)
    queue = [h.order[r.request_id] for r in sched.running] + [h.order[r.request_id] for r in sched.waiting]
    assert queue == sorted(queue), "FCFS order broken"
    assert set(plan.preempted_request_ids) <= {r.request_id for r in sched.waiting}
    kv.check_consistency()


@pytest.mark.subprocess
def test_modules_import_without_torch():
    """engine/ never imports torch (DESIGN.md): the whole CPU side loads with torch blocked."""
    code = ("import sys; sys.modules['torch'] = None; "
            "import deepinfer.engine.scheduler, deepinfer.engine.kv_manager, deepinfer.engine.llm_engine, "
            "deepinfer.engine.output_processor, deepinfer.engine.detokenizer, deepinfer.contracts.plan")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_add_request_refuses_requests_that_cannot_run():
    h = Harness(block_size=4, num_blocks=4, max_model_len=32)
    with pytest.raises(ValueError, match="must not be empty"):
        h.add("a", num_prompt=0)
    with pytest.raises(ValueError, match="prompt of 32 tokens leaves no room .* max_model_len 32"):
        h.add("a", num_prompt=32)
    with pytest.raises(ValueError, match="max_model_len 10"):
        h.add("a", num_prompt=10, max_model_len=10)
    with pytest.raises(ValueError, match="prompt of 12 tokens .* needs 17 tokens .* holds 16 tokens"):
        h.add("a", num_prompt=12, max_tokens=5)
    h.add("a", num_prompt=12, max_tokens=4)
    with pytest.raises(ValueError, match="already in use"):
        h.add("a")
    assert h.sched.num_waiting == 1
    h.run()


def test_chunked_prefill_then_decode():
    h = Harness(block_size=4, budget=4)
    req = h.add("a", num_prompt=10, max_tokens=3)
    spans = []
    while h.sched.has_unfinished_requests():
        plan, _ = h.step()
        (s,) = plan.scheduled
        spans.append((s.start_pos, s.num_tokens, s.do_sample, len(s.block_ids[0])))
    assert spans == [(0, 4, False, 1), (4, 4, False, 2), (8, 2, True, 3), (10, 1, True, 3), (11, 1, True, 3)]
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == reference_output(req, 256)


def test_decode_and_prefill_chunks_share_a_step():
    h = Harness(budget=8)
    h.add("a", num_prompt=3, max_tokens=5)
    h.add("b", num_prompt=20, max_tokens=2)
    shapes = [[(s.request_id, s.num_tokens, s.do_sample) for s in h.step()[0].scheduled] for _ in range(4)]
    assert shapes == [
        [("a", 3, True), ("b", 5, False)],
        [("a", 1, True), ("b", 7, False)],
        [("a", 1, True), ("b", 7, False)],
        [("a", 1, True), ("b", 1, True)],
    ]
    h.run()
    assert all(r.output_token_ids == reference_output(r, 256) for r in h.done.values())


@pytest.mark.parametrize("seats", [{"max_num_seqs": 2}, {"num_state_slots": 2}])
def test_max_num_seqs_and_state_slots_cap_running_requests(seats):
    h = Harness(budget=100, **seats)
    for rid in "abcde":
        h.add(rid, max_tokens=3)
    plan, _ = h.step()
    expected = [("a", (0,)), ("b", (1,))] if "num_state_slots" in seats else [("a", ()), ("b", ())]
    assert [(s.request_id, s.state_ids) for s in plan.scheduled] == expected
    assert h.sched.num_running == 2 and h.sched.num_waiting == 3
    h.run()
    assert len(h.done) == 5


def test_fcfs_head_of_queue_is_not_overtaken():
    h = Harness(block_size=4, num_blocks=4, budget=64)
    h.add("a", num_prompt=8, max_tokens=4)
    h.add("b", num_prompt=12, max_tokens=4)  # needs 3 blocks, only 2 free
    h.add("c", num_prompt=2, max_tokens=2)  # would fit, but arrived after b
    plan, _ = h.step()
    assert [s.request_id for s in plan.scheduled] == ["a"]
    assert [r.request_id for r in h.sched.waiting] == ["b", "c"]
    h.run()
    assert sorted(h.done) == ["a", "b", "c"]


def test_preemption_frees_the_newest_and_it_resumes_with_its_outputs():
    h = Harness(block_size=2, num_blocks=6, budget=64)
    a, b, c = (h.add(rid, num_prompt=4, max_tokens=6, ignore_eos=True) for rid in "abc")
    plan, _ = h.step()  # 2 blocks each: the pool is full
    assert [s.request_id for s in plan.scheduled] == ["a", "b", "c"] and h.kv.num_free_blocks == 0
    plan, _ = h.step()  # a and b need a third block: c (newest) goes
    assert [s.request_id for s in plan.scheduled] == ["a", "b"]
    assert plan.preempted_request_ids == ["c"]
    assert c.status is PREEMPTED and c.num_preemptions == 1 and c.num_computed_tokens == 0
    assert c.num_output_tokens == 1 and h.sched.waiting[0] is c and h.sched.num_preemptions_total == 1
    assert not h.kv.has_request("c")
    while c.status is not RUNNING:
        plan, _ = h.step()
    resumed = next(s for s in plan.scheduled if s.request_id == "c")
    assert resumed.start_pos == 0 and resumed.token_ids == c.prompt_token_ids + c.output_token_ids[:1]
    h.run()
    for req in (a, b, c):
        assert req.output_token_ids == reference_output(req, 256)


def test_request_preempts_itself_when_it_is_the_newest():
    h = Harness(block_size=2, num_blocks=4, budget=64)
    a = h.add("a", num_prompt=3, max_tokens=3, ignore_eos=True)
    b = h.add("b", num_prompt=4, max_tokens=3, ignore_eos=True)
    h.step()
    plan, _ = h.step()  # a still fits in 2 blocks; b needs a third and is the newest
    assert [s.request_id for s in plan.scheduled] == ["a"] and plan.preempted_request_ids == ["b"]
    assert a.status is RUNNING and b.status is PREEMPTED
    h.run()
    assert b.output_token_ids == reference_output(b, 256) and b.num_preemptions >= 1


@pytest.mark.parametrize("num_blocks,budget", [(5, 3), (6, 7), (8, 16), (10, 16), (20, 64)])
def test_preemption_does_not_change_tokens(num_blocks, budget):
    def run(num_blocks):
        h = Harness(block_size=2, num_blocks=num_blocks, budget=budget, max_num_seqs=6)
        for i in range(10):
            h.add(f"r{i}", num_prompt=1 + (5 * i) % 7, max_tokens=1 + (3 * i) % 4, ignore_eos=True)
        h.run()
        return h
    small, large = run(num_blocks), run(500)
    for rid, req in small.done.items():
        assert req.output_token_ids == large.done[rid].output_token_ids == reference_output(req, 256)
    assert large.sched.num_preemptions_total == 0
    assert (small.sched.num_preemptions_total > 0) == (num_blocks < 20)


def step_until(h: Harness, done, max_steps=50) -> None:
    for _ in range(max_steps):
        if done():
            return
        h.step()
    raise AssertionError("condition not reached")


def drive_to(h: Harness, where: str) -> Request:
    """Bring request "x" to a given point: waiting, mid_prefill, decoding or preempted."""
    h.add("old", num_prompt=4, max_tokens=8, ignore_eos=True)
    x = h.add("x", num_prompt=12, max_tokens=8, ignore_eos=True)
    if where == "mid_prefill":
        h.step()
        assert 0 < x.num_computed_tokens < x.num_prompt_tokens
    elif where == "decoding":
        step_until(h, lambda: x.num_output_tokens >= 2)
    elif where == "preempted":
        step_until(h, lambda: x.status is PREEMPTED)
        assert x.num_output_tokens >= 1 and not h.kv.has_request("x")
    expected = {"waiting": RequestStatus.WAITING, "preempted": PREEMPTED}.get(where, RUNNING)
    assert x.status is expected
    return x


@pytest.mark.parametrize("where", ["waiting", "mid_prefill", "decoding", "preempted"])
def test_abort_at_any_point_frees_everything(where):
    # 10 blocks of 2 hold both prompts, but not both requests while they decode
    h = Harness(block_size=2, num_blocks=10 if where == "preempted" else 32, budget=8)
    x = drive_to(h, where)
    assert h.abort("x")
    assert x.status is ABORTED and h.sched.get_request("x") is None and not h.kv.has_request("x")
    assert not h.abort("x") and not h.abort("never-added")
    plan, _ = h.step()
    assert plan.finished_request_ids == ["x"]
    h.run()
    assert h.done["old"].output_token_ids == reference_output(h.done["old"], 256)


def test_abort_between_schedule_and_update_is_skipped():
    h = Harness(budget=8)
    a, b = h.add("a", max_tokens=3), h.add("b", max_tokens=3)
    plan = h.sched.schedule()
    output = h.runner.execute(plan)
    assert h.abort("a")
    del h.done["a"]
    again = h.add("a", max_tokens=3)  # the id is free again; the old plan must not touch it
    assert [u.request for u in h.sched.update(plan, output)] == [b]
    assert a.output_token_ids == [] and a.status is ABORTED
    assert again.num_computed_tokens == 0 and again.output_token_ids == []
    plan, _ = h.step()
    assert plan.finished_request_ids == ["a"] and [s.request_id for s in plan.scheduled] == ["b", "a"]
    h.run()


def test_update_returns_requests_with_a_new_token_in_plan_order():
    h = Harness(budget=8)
    h.add("a", num_prompt=20)
    b, _ = h.add("b", num_prompt=2), h.add("c", num_prompt=1)
    h.step()  # a prefills 8
    _, updated = h.step()  # a prefills 8 more, b and c are not admitted yet
    assert updated == []
    plan, updated = h.step()  # a: last 4 tokens, b: 2, c: 1 -> all sample
    assert [s.request_id for s in plan.scheduled] == ["a", "b", "c"]
    assert [r.request_id for r in updated] == ["a", "b", "c"] and b.num_output_tokens == 1


def test_update_refuses_a_missing_sample():
    h = Harness()
    h.add("a")
    plan = h.sched.schedule()
    with pytest.raises(RuntimeError, match="'a' was planned to sample"):
        h.sched.update(plan, ModelOutput())


@pytest.mark.parametrize("params,eos,expected,status,stop_reason", [
    ({"stop_token_ids": [7]}, (), [5, 9, 3, 7], "stop", 7),
    ({}, (9,), [5, 9], "stop", None),
    ({"ignore_eos": True, "max_tokens": 3}, (9,), [5, 9, 3], "length", None),
    ({"max_tokens": 2}, (), [5, 9], "length", None),
    ({"stop_token_ids": [3]}, (9,), [5, 9], "stop", None),
    ({"stop_token_ids": [3], "max_tokens": 3, "ignore_eos": True}, (9,), [5, 9, 3], "stop", 3),
])
def test_stop_conditions(params, eos, expected, status, stop_reason):
    h = Harness(forced={"a": [5, 9, 3, 7, 1]})
    req = h.add("a", eos=eos, **params)
    h.run()
    assert req.output_token_ids == expected and req.status.value == status
    assert req.stop_reason == stop_reason and req.status.finish_reason == status


@pytest.mark.parametrize("scheduler_limit,request_limit", [(8, None), (256, 8), (9, 8)])
def test_max_model_len_ends_the_request(scheduler_limit, request_limit):
    h = Harness(max_model_len=scheduler_limit)
    req = h.add("a", num_prompt=5, max_tokens=100, max_model_len=request_limit, ignore_eos=True)
    h.run()
    assert req.num_tokens == 8 and req.status is RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == reference_output(req, 8)


def test_finish_request_from_the_engine():
    h = Harness()
    a, b = h.add("a", max_tokens=10), h.add("b", max_tokens=2)
    h.step()
    assert h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "</end>")
    assert a.status is RequestStatus.FINISHED_STOPPED and a.stop_reason == "</end>"
    assert not h.kv.has_request("a") and not h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    with pytest.raises(ValueError, match="finished status"):
        h.sched.finish_request("b", RequestStatus.RUNNING)
    h.done["a"] = a
    assert h.step()[0].finished_request_ids == ["a"] and b.status is RequestStatus.FINISHED_LENGTH
    assert h.step()[0].finished_request_ids == ["b"]
    assert h.step()[0].finished_request_ids == []  # each id is reported once


OPERATIONS = st.sampled_from(["add", "add", "step", "step", "step", "abort"])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_operations_keep_invariants(data):
    """Random add / step / abort sequences on random pools, then run to the end."""
    draw = data.draw
    h = Harness(block_size=draw(st.integers(1, 4), "block_size"),
                num_blocks=draw(st.integers(2, 12), "num_blocks"),
                budget=draw(st.integers(1, 16), "budget"),
                max_num_seqs=draw(st.integers(1, 5), "max_num_seqs"),
                max_model_len=draw(st.integers(2, 40), "max_model_len"))
    eos = frozenset(draw(st.sets(st.integers(100, 1099), max_size=150), "eos"))
    for _ in range(draw(st.integers(1, 50), "num_ops")):
        op = draw(OPERATIONS)
        if op == "add":
            add_random_request(h, draw, eos)
        elif op == "step" and h.sched.has_unfinished_requests():
            h.step()
        elif op == "abort":
            rid = f"r{draw(st.integers(0, max(len(h.order) - 1, 0)))}"
            expected = h.sched.get_request(rid) is not None
            assert h.abort(rid) == expected
    h.run()
    assert h.kv.num_free_blocks == h.kv.num_total_blocks
    for req in h.done.values():
        if req.status is not ABORTED:
            assert req.output_token_ids == reference_output(req, h.sched.max_model_len)


def add_random_request(h: Harness, draw, eos) -> None:
    """Add a request that fits the cache, or (1 in 8) one that may not; a refused one must not fit."""
    limit = min(h.sched.max_model_len, h.kv.max_num_tokens)
    num_total = draw(st.integers(2, max(limit, 2)))
    num_prompt = draw(st.integers(1, num_total - 1))
    max_tokens = num_total - num_prompt + (draw(st.integers(1, 8)) if draw(st.integers(0, 7)) == 0 else 0)
    rid = f"r{len(h.order)}"
    try:
        h.add(rid, num_prompt, eos=eos, max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
    except ValueError:
        limit = h.sched.max_model_len
        assert num_prompt >= limit or min(num_prompt + max_tokens, limit) > h.kv.max_num_tokens
        h.order[rid] = len(h.order)


@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 4), num_blocks=st.integers(2, 10), budget=st.integers(1, 12),
       max_num_seqs=st.integers(1, 6), sizes=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)),
                                                      min_size=1, max_size=10))
def test_tokens_do_not_depend_on_pool_size(block_size, num_blocks, budget, max_num_seqs, sizes):
    """However often requests are preempted, each one generates what it generates alone."""
    h = Harness(block_size, num_blocks, budget, max_num_seqs)
    limit = h.kv.max_num_tokens
    for i, (num_prompt, max_tokens) in enumerate(sizes):
        num_prompt = min(num_prompt, limit - 1)
        h.add(f"r{i}", num_prompt, max_tokens=min(max_tokens, limit - num_prompt), ignore_eos=True)
    h.run()
    assert sorted(h.done) == sorted(h.order)
    for req in h.done.values():
        assert req.output_token_ids == reference_output(req, 256)
