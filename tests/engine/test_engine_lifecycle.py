"""Request lifecycle edge cases of the engine: stop strings on the last step, re-used ids,
refusals that must leave nothing behind, and per-request state released when a request ends."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

PROMPT = list(range(10, 20))


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), num_blocks=64, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=32, max_model_len=128)


def _run(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_stop_string_in_the_last_allowed_token_reports_stop(llm):
    base = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = base.text.rstrip()
    # the shortest suffix whose first occurrence is at the end: it completes only in the last step
    stop = next(text[-n:] for n in range(2, len(text) + 1) if text.find(text[-n:]) == len(text) - n)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == text[:-len(stop)]


def test_abort_then_reuse_the_id_before_the_next_step(llm):
    engine = llm.engine
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request(PROMPT, p, request_id="x")
    engine.step()
    assert engine.abort_request("x")
    engine.add_request(PROMPT, p, request_id="x")
    aborted = [o for o in engine.step() if o.request_id == "x" and o.outputs[0].finish_reason == "abort"]
    assert len(aborted) == 1
    done = _run(engine)
    assert done["x"].outputs[0].finish_reason == "length" and len(done["x"].outputs[0].token_ids) == 4
    engine.kv_manager.check_no_leaks()


def test_a_refused_request_leaves_nothing_behind(llm):
    engine = llm.engine
    p = SamplingParams(max_tokens=4)
    p.stop = [""]  # made invalid after validation: the output side refuses it
    with pytest.raises(ValueError):
        engine.add_request(PROMPT, p, request_id="orphan")
    assert not engine.has_unfinished_requests() and not engine.outputs._states
    engine.step()
    engine.kv_manager.check_no_leaks()


def test_seeded_generators_and_states_are_released_when_requests_end(llm):
    llm.generate([PROMPT, PROMPT[:5]], SamplingParams(max_tokens=4, temperature=1.0, seed=3), use_tqdm=False)
    assert llm.engine.runner.steps.sampler.num_request_generators == 0
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, seed=5, ignore_eos=True))
    next(stream), next(stream)
    stream.close()
    assert llm.engine.runner.steps.sampler.num_request_generators == 0 and not llm.engine.outputs._states
    outs = llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "length"
