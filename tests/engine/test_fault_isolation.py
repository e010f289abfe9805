"""Fault isolation: one bad request never takes the engine down.

Faults are injected by monkeypatching (the sampler, one request's detokenizer, the model's
forward). In each case the chosen request ends with finish_reason "error" and a
RequestFailedError, the rest of its batch produces exactly the tokens of a clean run, every block
and state slot is free afterwards, the sampler holds no generator for it, and the engine goes on.
Faults no request can be blamed for propagate out of `step()` and leave nothing scheduled.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import FatalStepError, describe_fault, is_fatal_fault
from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.outputs import RequestFailedError
from deepinfer.serving.engine_loop import EngineClosedError, EngineLoop
from deepinfer.serving.metrics import ServerMetrics

BAD = "bad"
POISON = 40000  # a token id only the bad request's prompt holds


def _requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """A batch of greedy and seeded requests (their tokens do not depend on the rest of the batch).
    "b" (seeded) comes before the bad one, so its draw happens before the bad row's in a batch."""
    return {
        "a": (list(range(10, 20)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
        "b": ([30, 31, 32, 33, 34], SamplingParams(max_tokens=7, temperature=1.0, seed=7, ignore_eos=True)),
        BAD: ([50, 51, 52, POISON, 53], SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)),
        "c": ([70, 71, 72], SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True)),
        "d": ([80, 81, 82, 83], SamplingParams(max_tokens=6, temperature=0.7, seed=3, top_k=50,
                                               ignore_eos=True)),
    }


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    # no prefix caching: every test here must recompute the poisoned prompt the clean run computed
    return LLM(tiny_checkpoint("llama"), num_blocks=64, block_size=4, max_num_seqs=8,
               max_num_batched_tokens=128, max_model_len=128, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def clean(llm) -> dict:
    """The batch's final outputs without any fault."""
    outs = _run(llm.engine)
    assert all(POISON not in o.outputs[0].token_ids for o in outs.values())
    assert all(o.error is None for o in outs.values())
    return outs


def _run(engine, after_add=None) -> dict:
    """Add the batch (then call `after_add(engine)`), step until done -> request id -> final output."""
    for request_id, (prompt, params) in _requests().items():
        engine.add_request(prompt, params, request_id=request_id)
    if after_add is not None:
        after_add(engine)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def _assert_engine_clean(llm) -> None:
    engine = llm.engine
    engine.kv_manager.check_no_leaks()
    assert not engine.has_unfinished_requests() and not engine.outputs._states
    assert engine.runner.steps.sampler.num_request_generators == 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 3
    engine.kv_manager.check_no_leaks()


def _assert_isolated(llm, outs: dict, clean: dict, stage: str) -> None:
    assert set(outs) == set(clean)
    bad = outs[BAD]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert isinstance(bad.error, RequestFailedError) and stage in str(bad.error) and BAD in str(bad.error)
    assert "Traceback" not in str(bad.error) and "\n" not in str(bad.error)
    for request_id, out in outs.items():
        if request_id != BAD:
            assert out.error is None
            assert out.outputs[0].token_ids == clean[request_id].outputs[0].token_ids, request_id
            assert out.outputs[0].text == clean[request_id].outputs[0].text
            assert out.outputs[0].finish_reason == clean[request_id].outputs[0].finish_reason
    _assert_engine_clean(llm)


def _bad_row(metadata) -> int | None:
    return metadata.request_ids.index(BAD) if BAD in metadata.request_ids else None


@pytest.mark.parametrize("after", [0, 3])
def test_sampler_fault_fails_one_request(llm, clean, monkeypatch, caplog, after):
    real = Sampler.__call__

    def faulty(self, logits, metadata):
        row = _bad_row(metadata)
        if row is not None and len(metadata.output_token_ids[row]) >= after:
            raise RuntimeError("injected sampler fault")
        return real(self, logits, metadata)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    outs = _run(llm.engine)
    assert len(outs[BAD].outputs[0].token_ids) == after
    assert outs[BAD].outputs[0].token_ids == clean[BAD].outputs[0].token_ids[:after]
    assert "injected sampler fault" in caplog.text and "Traceback" in caplog.text  # logged with its traceback
    _assert_isolated(llm, outs, clean, "sampling")


def test_fault_after_other_rows_drew_replays_their_draws(llm, clean, monkeypatch):
    """The bad row's generator fails (as a seed torch refuses would) after "b" drew its uniform in
    the batch: the row-by-row retry starts from the saved generator states, so "b" draws the same."""
    real = Sampler._request_generator

    def faulty(self, metadata, row):
        if metadata.request_ids[row] == BAD:
            raise ValueError("Overflow when unpacking long long")
        return real(self, metadata, row)

    monkeypatch.setattr(Sampler, "_request_generator", faulty)
    outs = _run(llm.engine)
    assert outs[BAD].outputs[0].token_ids == []
    _assert_isolated(llm, outs, clean, "sampling")


def test_detokenizer_fault_fails_one_request(llm, clean, monkeypatch):
    def poison_detokenizer(engine):
        detokenizer = engine.outputs._states[BAD].detokenizer
        real = detokenizer.add_tokens

        def faulty(token_ids):
            if len(detokenizer.output_token_ids) >= 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
            return real(token_ids)

        monkeypatch.setattr(detokenizer, "add_tokens", faulty)

    outs = _run(llm.engine, after_add=poison_detokenizer)
    assert "output processing" in str(outs[BAD].error)
    assert outs[BAD].outputs[0].token_ids == clean[BAD].outputs[0].token_ids[:3]
    _assert_isolated(llm, outs, clean, "output processing")


def _poison_forward(llm, monkeypatch, poisoned) -> None:
    model_cls = type(llm.engine.runner.model)
    real = model_cls.forward

    def forward(self, input_ids, positions):
        if poisoned(input_ids, positions):
            raise RuntimeError("injected forward fault")
        return real(self, input_ids, positions)

    monkeypatch.setattr(model_cls, "forward", forward)


def _has_poison(input_ids, positions) -> bool:
    return bool((input_ids == POISON).any())


def test_forward_fault_on_a_poison_token_fails_one_request(llm, clean, monkeypatch):
    _poison_forward(llm, monkeypatch, _has_poison)
    reqs = _requests()
    outs = llm.generate([p for p, _ in reqs.values()], [s for _, s in reqs.values()], use_tqdm=False)
    by_name = dict(zip(reqs, outs, strict=True))
    bad = by_name[BAD]
    assert bad.outputs[0].token_ids == [] and "model step" in str(bad.error)
    assert bad.outputs[0].finish_reason == "error" and isinstance(bad.error, RequestFailedError)
    for name, out in by_name.items():
        if name != BAD:
            assert out.error is None and out.outputs[0].token_ids == clean[name].outputs[0].token_ids, name
    _assert_engine_clean(llm)


def test_forward_fault_in_a_later_decode_fails_one_request(llm, clean, monkeypatch):
    """Poison the bad request's 4th output token at its position: the bad request fails in its
    4th decode step, holding blocks, while the others still run."""
    position, token = len(_requests()[BAD][0]) + 3, clean[BAD].outputs[0].token_ids[3]
    for request_id, (prompt, _) in _requests().items():  # no other request feeds that pair
        tokens = prompt + clean[request_id].outputs[0].token_ids
        assert request_id == BAD or len(tokens) <= position or tokens[position] != token

    def poisoned(input_ids, positions):
        return bool(((positions == position) & (input_ids == token)).any())

    _poison_forward(llm, monkeypatch, poisoned)
    outs = _run(llm.engine)
    assert outs[BAD].outputs[0].token_ids == clean[BAD].outputs[0].token_ids[:4]
    _assert_isolated(llm, outs, clean, "model step")


def test_out_of_range_seed_is_refused_before_admission(llm):
    with pytest.raises(ValueError, match=rf"seed.*{2**64}"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match=rf"seed.*{-2**63 - 1}"):
        SamplingParams(seed=-2**63 - 1)
    params = SamplingParams(temperature=1.0)
    params.seed = 2**64  # changed after validation: add_request validates again
    with pytest.raises(ValueError, match=rf"prompts\[0\]: seed.*{2**64}"):
        llm.generate(["hi"], params, use_tqdm=False)
    for seed in (2**64 - 1, -2**63):
        ok = llm.generate(["hi"], SamplingParams(seed=seed, temperature=1.0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)[0]
        assert ok.error is None and len(ok.outputs[0].token_ids) == 3
    _assert_engine_clean(llm)


def test_the_engine_keeps_its_own_copy_of_the_params(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    request_id = llm.engine.add_request([1, 2, 3], params)
    params.max_tokens = 0  # the caller's object changes; the admitted request does not
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert len(done[request_id].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request([1, 2, 3], params)


# ---- faults no request can be blamed for -------------------------------------------------------

def test_a_model_that_always_fails_is_fatal(llm, monkeypatch):
    _poison_forward(llm, monkeypatch, lambda ids, pos: True)
    engine = llm.engine
    for request_id, (prompt, params) in _requests().items():
        engine.add_request(prompt, params, request_id=request_id)
    with pytest.raises(RuntimeError, match="injected forward fault"):
        engine.step()  # every solo retry failed too
    for request_id in _requests():
        engine.abort_request(request_id)
    engine.step()
    reqs = _requests()
    with pytest.raises(RuntimeError, match="injected forward fault"):
        llm.generate([p for p, _ in reqs.values()], [s for _, s in reqs.values()], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    engine.kv_manager.check_no_leaks()
    monkeypatch.undo()
    _assert_engine_clean(llm)


def test_a_lone_failing_request_fails_alone_and_a_second_in_a_row_is_fatal(llm, monkeypatch):
    """A one-request step has nothing to compare with: its request fails, the engine goes on; a
    request that succeeds resets the count; two one-request steps failing in a row are fatal."""
    _poison_forward(llm, monkeypatch, _has_poison)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    (out,) = llm.generate([[1, POISON, 2]], greedy, use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and isinstance(out.error, RequestFailedError)
    (ok,) = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)
    assert ok.error is None and len(ok.outputs[0].token_ids) == 3
    (again,) = llm.generate([[4, POISON, 5]], greedy, use_tqdm=False)
    assert again.outputs[0].finish_reason == "error"
    llm.engine.kv_manager.check_no_leaks()
    _poison_forward(llm, monkeypatch, lambda ids, pos: True)
    with pytest.raises(RuntimeError, match="injected forward fault"):
        llm.generate([[6, 7, 8]], greedy, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    _assert_engine_clean(llm)


@pytest.mark.parametrize("fault", [MemoryError("injected"), FatalStepError("injected"), KeyboardInterrupt()])
def test_fatal_faults_in_sampling_propagate_and_leave_nothing_scheduled(llm, monkeypatch, fault):
    real, calls = Sampler.__call__, []

    def faulty(self, logits, metadata):
        calls.append(metadata.num_rows)
        if len(calls) == 3:
            raise fault
        return real(self, logits, metadata)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    reqs = _requests()
    with pytest.raises(type(fault)):
        llm.generate([p for p, _ in reqs.values()], [s for _, s in reqs.values()], use_tqdm=False)
    assert len(calls) == 3  # not retried row by row
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()
    monkeypatch.undo()
    _assert_engine_clean(llm)


def test_fault_classification():
    assert is_fatal_fault(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_fatal_fault(MemoryError()) and is_fatal_fault(FatalStepError("x"))
    assert is_fatal_fault(KeyboardInterrupt())
    assert not is_fatal_fault(RuntimeError("x")) and not is_fatal_fault(ValueError("x"))
    message = describe_fault("sampling", ValueError("first line\nsecond line " + "x" * 500))
    assert message == "sampling failed: ValueError: first line"
    assert len(describe_fault("sampling", ValueError("y" * 500))) < 260


# ---- the server's engine loop -------------------------------------------------------------------

class _FatalEngine:
    """Just enough of an LLMEngine for the engine loop; every step fails fatally."""

    def __init__(self):
        self.pending: list[str] = []
        self.fault = FatalStepError("injected: the device is gone")

    def get_metrics(self) -> dict:
        return {"num_requests_running": 0, "num_requests_waiting": len(self.pending), **SpecDecodeStats().as_dict()}

    def add_request(self, prompt, params, request_id):
        self.pending.append(request_id)

    def abort_request(self, request_id):
        return False

    def has_unfinished_requests(self):
        return bool(self.pending)

    def step(self):
        raise self.fault


def test_engine_loop_calls_on_fatal_once_after_closing():
    engine, calls, called = _FatalEngine(), [], threading.Event()

    async def main():
        def on_fatal(exc):
            calls.append((exc, threading.current_thread().name, loop._closed))
            called.set()

        loop = EngineLoop(engine, on_fatal=on_fatal)
        loop.start()
        handle = await loop.add("r1", [1, 2, 3], SamplingParams())
        with pytest.raises(EngineClosedError, match="device is gone"):
            async for _ in handle:
                pass
        assert await asyncio.to_thread(called.wait, 10)
        await asyncio.to_thread(loop._thread.join, 10)
        assert not loop.alive and not loop.accepting and loop.error is engine.fault
        with pytest.raises(EngineClosedError):
            await loop.add("r2", [1], SamplingParams())

    asyncio.run(main())
    assert calls == [(engine.fault, "deepinfer-engine", True)]


def test_engine_loop_does_not_call_on_fatal_on_a_clean_stop(llm):
    calls = []

    async def main():
        loop = EngineLoop(llm.engine, on_fatal=calls.append)
        loop.start()
        await asyncio.to_thread(loop.stop)

    asyncio.run(main())
    assert calls == []


def test_engine_loop_delivers_and_counts_a_failed_request(llm, clean, monkeypatch):
    real = Sampler.__call__

    def faulty(self, logits, metadata):
        if _bad_row(metadata) is not None:
            raise RuntimeError("injected sampler fault")
        return real(self, logits, metadata)

    monkeypatch.setattr(Sampler, "__call__", faulty)
    metrics, calls = ServerMetrics(), []

    async def collect(handle):
        return [out async for out in handle]

    async def main():
        loop = EngineLoop(llm.engine, metrics, on_fatal=calls.append)
        loop.start()
        handles = {rid: await loop.add(rid, prompt, params) for rid, (prompt, params) in _requests().items()}
        streams = dict(zip(handles, await asyncio.gather(*(collect(h) for h in handles.values())), strict=True))
        assert loop.alive
        await asyncio.to_thread(loop.stop)
        return streams

    streams = asyncio.run(main())
    last = streams[BAD][-1]
    assert last.finished and last.outputs[0].finish_reason == "error" and isinstance(last.error, RequestFailedError)
    for rid, outs in streams.items():
        if rid != BAD:
            assert outs[-1].outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert _count_requests(metrics, "error") == 1.0 and calls == []  # counted once, whatever its status label
    _assert_engine_clean(llm)


def _count_requests(metrics: ServerMetrics, finish_reason: str) -> float:
    return sum(sample.value for family in metrics.registry.collect() for sample in family.samples
               if sample.name == "deepinfer_requests_total" and sample.labels["finish_reason"] == finish_reason)
