"""Scheduling policies (fcfs, priority) and the fair share between clients (engine/request_queue.py).

The scheduler-level tests use the fake runner of test_scheduler.py, which checks every plan's
positions and block tables against what it wrote; tokens must equal each request's solo run
(`reference_output`), however often a request was preempted.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import FakeRunner, make_prompt, reference_output

from deepinfer.config import SchedulerConfig
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.request_queue import FCFSQueue, PriorityQueue, make_request_queue
from deepinfer.engine.scheduler import Scheduler
from deepinfer.sampling_params import SamplingParams


class PolicyHarness:
    """A scheduler under `policy` with the fake runner; records admissions and finishes in order."""

    def __init__(self, policy="priority", block_size=4, num_blocks=64, budget=32, max_num_seqs=2):
        self.kv = KVCacheManager((PagedGroupSpec("full", block_size),), num_blocks)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, scheduling_policy=policy), self.kv, 256)
        self.runner = FakeRunner(block_size)
        self.num_free_at_start = self.kv.num_free_blocks
        self.arrival = 0.0
        self.admitted: list[str] = []  # request ids, once per admission (a re-admission again)
        self.finished: list[Request] = []

    def add(self, rid, num_prompt=4, priority=0, client_id=None, **params) -> Request:
        self.arrival += 1.0  # explicit arrival times: the order never depends on the clock
        req = Request(rid, make_prompt(rid, num_prompt), SamplingParams(ignore_eos=True, **params),
                      arrival_time=self.arrival, priority=priority, client_id=client_id)
        self.sched.add_request(req)
        return req

    def step(self):
        was_running = {r.request_id for r in self.sched.running}
        plan = self.sched.schedule()
        admitted = [s.request_id for s in plan.scheduled if s.request_id not in was_running]
        self.admitted += admitted
        self._check(plan, admitted)
        updated = self.sched.update(plan, self.runner.execute(plan))
        self.finished += [u.request for u in updated if u.request.is_finished]
        return plan

    def _check(self, plan, admitted: list[str]) -> None:
        """Invariants: running stays sorted by the policy's order, blocks add up, and no request
        admitted in this step has a worse priority than one left waiting."""
        running = self.sched.running
        assert running == sorted(running, key=self.sched.waiting.order_key)
        assert not set(admitted) & set(plan.preempted_request_ids), "re-admitted in the step that preempted it"
        if admitted and self.sched.waiting:
            worst = max(self.sched.get_request(rid).priority for rid in admitted)
            assert worst <= min(r.priority for r in self.sched.waiting)
        self.kv.check_consistency()

    def run(self, max_steps=5000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        assert not self.sched.has_unfinished_requests(), "no progress"
        self.kv.check_no_leaks()
        assert self.kv.num_free_blocks == self.num_free_at_start
        for req in self.finished:
            assert req.output_token_ids == reference_output(req, 256)


# ---- priority ----------------------------------------------------------------------------------

@pytest.mark.parametrize("short_of", ["seats", "blocks"])
def test_high_priority_behind_32_low_ones_finishes_first(short_of):
    """32 low-priority requests fill the seats (or the blocks: one 16-token block each holds a whole
    request); a high-priority one that arrives after them preempts a running one at once and
    finishes first."""
    h = PolicyHarness(block_size=16, max_num_seqs=2 if short_of == "seats" else 8,
                      num_blocks=64 if short_of == "seats" else 4)
    for i in range(32):
        h.add(f"low{i}", num_prompt=4, priority=5, max_tokens=12)
    h.step()
    h.step()
    high = h.add("high", num_prompt=4, priority=-1, max_tokens=3)
    plan = h.step()
    assert "high" in [s.request_id for s in plan.scheduled] and plan.preempted_request_ids
    preempted = [h.sched.get_request(rid) for rid in plan.preempted_request_ids]
    assert all(r.status is RequestStatus.PREEMPTED and r.priority == 5 for r in preempted)
    h.run()
    assert h.finished[0] is high
    assert len(h.finished) == 33


def test_equal_priority_never_preempts_for_a_waiting_request():
    h = PolicyHarness(max_num_seqs=1)
    h.add("a", priority=1, max_tokens=6)
    h.step()
    h.add("b", priority=1, max_tokens=2)
    plans = [h.step() for _ in range(3)]
    assert not any(p.preempted_request_ids for p in plans) and h.admitted == ["a"]
    h.run()
    assert [r.request_id for r in h.finished] == ["a", "b"]


def test_preemption_for_memory_takes_the_worst_priority_not_the_newest():
    h = PolicyHarness(block_size=2, num_blocks=6, budget=64, max_num_seqs=8)
    for rid, priority in (("a", 0), ("b", 2), ("c", 1)):  # c is the newest, b the worst
        h.add(rid, num_prompt=4, priority=priority, max_tokens=6)
    h.step()
    assert h.kv.num_free_blocks == 0
    plan = h.step()  # a and c need a third block: b goes
    assert plan.preempted_request_ids == ["b"]
    assert [r.request_id for r in h.sched.running] == ["a", "c"]
    h.run()


def test_fcfs_preempts_the_newest_and_admits_in_arrival_order():
    h = PolicyHarness("fcfs", block_size=2, num_blocks=6, budget=64, max_num_seqs=8)
    for rid in "abc":
        h.add(rid, num_prompt=4, max_tokens=6)
    h.step()
    assert h.step().preempted_request_ids == ["c"]
    h.run()
    assert h.admitted[:3] == ["a", "b", "c"]

    h = PolicyHarness("fcfs", max_num_seqs=1)
    for i in range(6):
        h.add(f"r{i}", max_tokens=2)
    h.run()
    assert h.admitted == [f"r{i}" for i in range(6)] == [r.request_id for r in h.finished]


def test_fcfs_refuses_a_priority_and_bad_values_are_named():
    h = PolicyHarness("fcfs")
    with pytest.raises(ValueError, match=r"priority must be 0 under the fcfs scheduling policy, got 3"):
        h.add("a", priority=3)
    with pytest.raises(ValueError, match=r"priority must be an integer, got True"):
        PolicyHarness().add("a", priority=True)
    with pytest.raises(ValueError, match=r"client_id must be a string or None, got 7"):
        PolicyHarness().add("a", client_id=7)
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of 'fcfs', 'priority', got 'lifo'"):
        SchedulerConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match=r"got 'lifo'"):
        make_request_queue("lifo")
    assert not h.sched.has_unfinished_requests() and h.sched.num_waiting == 0


def test_low_priority_waits_only_while_better_ones_wait():
    """A stream of high-priority requests preempts a running low one and keeps it waiting; the
    step after the stream ends (a seat free, nothing better waiting) it is admitted again."""
    h = PolicyHarness(max_num_seqs=1)
    low = h.add("low", priority=9, max_tokens=4)
    h.step()
    for i in range(10):
        h.add(f"high{i}", priority=0, max_tokens=1)
        h.step()
        assert low.status is RequestStatus.PREEMPTED and low.num_preemptions == 1
    while h.sched.num_waiting > 1:
        h.step()
    assert low.status is RequestStatus.PREEMPTED
    h.step()  # the last high request finished in the step before: nothing better waits
    assert low.status is RequestStatus.RUNNING
    h.run()
    assert h.finished[-1] is low


# ---- fair share between clients ---------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["fcfs", "priority"]), max_num_seqs=st.integers(1, 4),
       num_blocks=st.integers(8, 40), budget=st.integers(4, 32), lone_after=st.integers(0, 50),
       steps_before=st.integers(0, 6), sizes=st.lists(st.integers(1, 12), min_size=50, max_size=50))
def test_a_lone_client_is_not_starved_by_a_flood(policy, max_num_seqs, num_blocks, budget, lone_after,
                                                 steps_before, sizes):
    """Client "flood" sends 50 requests, client "lone" one, in between (after `lone_after` of them,
    and `steps_before` steps). The bound (request_queue's docstring): at most one admission of the
    flooding client comes between the lone request's arrival and its admission."""
    h = PolicyHarness(policy, block_size=4, num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs)
    for i in range(lone_after):
        h.add(f"f{i}", num_prompt=sizes[i], client_id="flood", max_tokens=3)
    for _ in range(steps_before):
        h.step()
    admitted_before = len(h.admitted)
    h.add("lone", num_prompt=4, client_id="lone", max_tokens=3)
    for i in range(lone_after, 50):
        h.add(f"f{i}", num_prompt=sizes[i], client_id="flood", max_tokens=3)
    for _ in range(1000):
        if "lone" in h.admitted:
            break
        h.step()
    assert h.admitted.index("lone") - admitted_before <= 1
    h.run()


def test_clients_share_admissions_by_service():
    """Three clients queue 4 requests each, one seat: admissions rotate between them (each
    request has the same size, so equal service), not client by client."""
    h = PolicyHarness("fcfs", max_num_seqs=1)
    for client in "abc":
        for i in range(4):
            h.add(f"{client}{i}", num_prompt=4, client_id=client, max_tokens=2)
    h.run()
    assert h.admitted[:6] == ["a0", "b0", "c0", "a1", "b1", "c1"]


def test_queue_order_and_virtual_time():
    q = PriorityQueue()
    reqs = [Request(rid, [1], SamplingParams(), arrival_time=t, priority=p, client_id=c)
            for rid, t, p, c in (("x", 1.0, 1, "a"), ("y", 2.0, 0, "a"), ("z", 3.0, 0, "b"))]
    for req in reqs:
        q.add(req)
    assert [r.request_id for r in q] == ["y", "z", "x"] and len(q) == 3
    assert q.peek().request_id == "y"  # best priority; among equals, a's older head
    q.admit(q.peek())
    q.charge(reqs[1], 10)
    assert q.peek().request_id == "z" and q.service("a") == 10 and q.virtual_time == 0
    q.admit(q.peek())
    assert q.peek().request_id == "x" and FCFSQueue.order_key(reqs[0]) == (1.0, "x")
    q.remove(reqs[0])
    assert not q and q.peek() is None


# ---- the engine and LLM ------------------------------------------------------------------------

def test_llm_priority_runs_first_and_tokens_match(tiny_checkpoint):
    """Engine-level: with the priority policy and 2 seats, a high-priority request queued behind
    8 running low ones finishes first; every request's greedy tokens equal a plain run's, and the
    KV blocks all come back."""
    from deepinfer import LLM

    llm = LLM(tiny_checkpoint("llama"), num_blocks=48, block_size=4, max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=64, scheduling_policy="priority", enable_prefix_caching=False)
    engine, free_at_start = llm.engine, llm.engine.kv_manager.num_free_blocks
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [list(range(10 + i, 20 + i)) for i in range(9)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, prompt in enumerate(prompts[:8]):
        engine.add_request(prompt, params, request_id=f"low{i}", priority=3, client_id="batch")
    engine.step()
    engine.add_request(prompts[8], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                       request_id="high", priority=0)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].request_id == "high" and engine.scheduler.num_preemptions_total >= 1
    by_id = {o.request_id: o.outputs[0].token_ids for o in finished}
    assert [by_id[f"low{i}"] for i in range(8)] == alone[:8] and by_id["high"] == alone[8][:2]
    assert engine.kv_manager.num_free_blocks == free_at_start
    outs = llm.generate(prompts[:2], params, use_tqdm=False, priority=[1, 0])
    assert [o.outputs[0].token_ids for o in outs] == alone[:2]
    with pytest.raises(ValueError, match=r"priority has 1 entries for 2 prompts"):
        llm.generate(prompts[:2], params, use_tqdm=False, priority=[1])
