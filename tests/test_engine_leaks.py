"""No leaks: every block and ring state slot returns to its pool after finish, abort and
preemption, over random operation sequences on a hybrid (paged + ring) model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams

OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
), min_size=1, max_size=25)


@pytest.fixture(scope="module")
def hybrid_llm(tiny_checkpoint):
    # gemma3 tiny: sliding layers (ring group) and a global layer (paged group); few blocks and
    # 3 state slots force preemption and waiting for slots.
    return LLM(tiny_checkpoint("gemma3"), num_blocks=12, block_size=4, max_num_seqs=3,
               max_num_batched_tokens=13, max_model_len=48)  # 12 blocks of 4 hold one request


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_operations_leave_no_block_or_slot_behind(hybrid_llm, ops):
    engine = hybrid_llm.engine
    ids = []
    for op, a, b in ops:
        if op == "add":
            try:
                ids.append(engine.add_request(list(range(3, 3 + a)), SamplingParams(max_tokens=b, ignore_eos=True)))
            except ValueError:
                pass  # more than the whole cache can hold: refused, and it must leave nothing behind
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif ids:
            engine.abort_request(ids[a % len(ids)])
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_manager.check_no_leaks()


FAULT_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("fail"), st.integers(0, 20), st.sampled_from(["sample", "forward"])),
), min_size=1, max_size=25)


class _Faults:
    """Request ids whose next sampling (in the sampler) or next model step (in the runner) fails."""

    def __init__(self):
        self.sample: set[str] = set()
        self.forward: set[str] = set()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(FAULT_OPS)
def test_random_faults_leave_no_block_or_slot_behind(hybrid_llm, monkeypatch, ops):
    """Requests failed by faults in sampling or in the model step (alone or not, while others are
    preempted, waiting or aborted) give back every block and slot; a one-request step that fails
    is fatal, and aborting what is left still leaves nothing behind."""
    from deepinfer.model_executor.layers.sampler import Sampler

    engine, faults, ids = hybrid_llm.engine, _Faults(), []
    real_sample, real_execute = Sampler.__call__, type(engine.runner).execute

    def sample(self, logits, metadata):
        if faults.sample & set(metadata.request_ids):
            raise RuntimeError("injected sampler fault")
        return real_sample(self, logits, metadata)

    def execute(self, plan):
        if faults.forward & {s.request_id for s in plan.scheduled}:
            raise RuntimeError("injected forward fault")
        return real_execute(self, plan)

    monkeypatch.setattr(Sampler, "__call__", sample)
    monkeypatch.setattr(type(engine.runner), "execute", execute)
    for op, a, b in ops:
        if op == "add":
            try:
                ids.append(engine.add_request(list(range(3, 3 + a)), SamplingParams(max_tokens=b, ignore_eos=True)))
            except ValueError:
                pass
        elif op == "step":
            for _ in range(a):
                _step(engine, faults)
        elif ids and op == "abort":
            engine.abort_request(ids[a % len(ids)])
        elif ids:
            getattr(faults, b).add(ids[a % len(ids)])
    while engine.has_unfinished_requests():
        _step(engine, faults)
    engine.kv_manager.check_no_leaks()
    assert engine.runner.steps.sampler.num_request_generators == 0


def _step(engine, faults: _Faults) -> None:
    try:
        outs = engine.step()
    except RuntimeError as exc:  # a one-request step failed: fatal; its caller aborts what is left
        assert "injected forward fault" in str(exc)
        for request_id in faults.forward:
            engine.abort_request(request_id)
        return
    for out in outs:
        if out.finished and out.outputs[0].finish_reason == "error":
            assert out.request_id in faults.sample | faults.forward
