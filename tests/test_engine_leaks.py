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
               max_num_batched_tokens=13, max_model_len=128)


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
