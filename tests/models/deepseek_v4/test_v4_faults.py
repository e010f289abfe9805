"""Fault isolation on DeepSeek-V4: a fault mid-forward fails only its own request.

A V4 step advances per-request state beside the caches (every compressor's token count, open
window and half A) and a prefill chunk overwrites window rows it has just loaded. When a step
raises, the runner puts both back (`worker/step_undo.py`), so the engine's one-request-at-a-time
re-run finds the culprit. The fault is injected after the last decoder layer ran (every
compressor state advanced, every row stored) in a step with a prefill chunk that overwrites its
window, in a plain decode step and in a verification step (scripted drafts): the chosen request
fails, the others' greedy tokens equal a clean run's, every block and state slot comes back, and
right after the failed step every state a re-run reads is as it was before it.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from v4_tiny import CSA, HCA, SLIDING, VOCAB, WINDOW, make_tiny_v4

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.models.deepseek_v4.model import DeepseekV4DecoderLayer
from deepinfer.outputs import RequestFailedError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "spec_decode"))
from spec_helpers import ScriptedDrafter, mixed  # noqa: E402

LAYERS = [SLIDING, CSA, HCA]
BAD, POISON, K = "bad", 500, 3
ENGINE = dict(block_size=2, num_blocks=160, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=75,
              enable_prefix_caching=False)  # no hits: the faulty runs compute what the clean run computed
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompts() -> dict[str, list[int]]:
    """Admitted in this order, the bad request's first chunk (POISON at position 0) shares its step
    with c's second chunk (7 tokens at 7 .. 19 with W = 8, S = 14: it loads rows it overwrites)."""
    rng = random.Random(5)
    prompts = {rid: [rng.randrange(3, VOCAB) for _ in range(n)] for rid, n in (("a", 21), ("b", 19), ("c", 20))}
    prompts[BAD] = [POISON] + [rng.randrange(3, VOCAB) for _ in range(8)]
    assert all(p[0] != POISON for rid, p in prompts.items() if rid != BAD)
    return prompts


def _run(engine) -> dict:
    for request_id, prompt in _prompts().items():
        engine.add_request(prompt, GREEDY, request_id=request_id)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("v4-faults"))
    make_tiny_v4(path, LAYERS)
    return path


@pytest.fixture(scope="module")
def plain(v4_path) -> LLM:
    return LLM(v4_path, **ENGINE)


@pytest.fixture(scope="module")
def clean(plain) -> dict[str, list[int]]:
    outs = _run(plain.engine)
    assert all(o.error is None for o in outs.values())
    return {rid: o.outputs[0].token_ids for rid, o in outs.items()}


@pytest.fixture(scope="module")
def spec(v4_path, clean) -> LLM:
    """Verification steps with scripted drafts of the clean run: accepted, partly and fully rejected."""
    llm = LLM(v4_path, speculative_method="ngram", num_speculative_tokens=K, **ENGINE)
    continuations = {tuple(p): clean[rid] for rid, p in _prompts().items()}
    llm.engine.runner.steps.drafter = ScriptedDrafter(continuations, K, VOCAB, mixed)
    return llm


# ---- the fault and what a re-run reads ----------------------------------------------------------

def _poison_last_layer(monkeypatch, poisoned) -> None:
    """The last decoder layer runs, then raises if `poisoned(input_ids, positions)`."""
    real = DeepseekV4DecoderLayer.forward

    def forward(self, streams, positions, input_ids):
        out = real(self, streams, positions, input_ids)
        if self.self_attn.layer_idx == len(LAYERS) - 1 and poisoned(input_ids, positions):
            raise RuntimeError("injected forward fault")
        return out

    monkeypatch.setattr(DeepseekV4DecoderLayer, "forward", forward)


def _rerun_state(runner, plan) -> list[torch.Tensor]:
    """What a re-run of each request of `plan` reads beside its paged rows: every compressor's
    token count, valid open-window rows and half A in its state slot, and the ring rows of its
    window before the step, all layers."""
    swa = next(gi for gi, g in enumerate(runner.groups) if g.name == "swa")
    group = runner.groups[swa]
    state = []
    for s in plan.scheduled:
        slot = s.state_ids[0]
        for bank in runner.model.state_banks:
            n = bank.num_tokens[slot]
            valid = n % bank.kv.shape[1]
            state += [torch.tensor(n), bank.kv[slot, :valid].clone(), bank.score[slot, :valid].clone(),
                      bank.prev_a_kv[slot].clone(), bank.prev_a_score[slot].clone()]
        unit = runner.caches.cache.allocations[swa][slot].view(len(group.layer_ids), group.rows_per_unit, -1)
        rows = [x % group.rows_per_unit for x in range(max(0, s.start_pos - WINDOW + 1), s.start_pos)]
        state.append(unit[:, rows].clone())  # [layers, rows, row bytes]
    return state


class _StepWatch:
    """The runner's execute, watched: for each step of several requests that raises, whether what
    a re-run of each of them reads is as it was before the step."""

    def __init__(self, runner):
        self.runner, self.execute = runner, runner.execute
        self.failed, self.restored = [], []  # plans of several requests that raised; was each put back

    def __call__(self, plan):
        before = _rerun_state(self.runner, plan)
        try:
            return self.execute(plan)
        except RuntimeError:
            if len(plan.scheduled) > 1:
                after = _rerun_state(self.runner, plan)
                self.failed.append(plan)
                self.restored.append(all(torch.equal(a, b) for a, b in zip(after, before, strict=True)))
            raise


def _run_faulty(llm: LLM, monkeypatch, poisoned):
    """A run of the batch with the fault; returns (request id -> final output, the failed plan)."""
    _poison_last_layer(monkeypatch, poisoned)
    watch = _StepWatch(llm.engine.runner)
    monkeypatch.setattr(llm.engine.runner, "execute", watch)
    outs = _run(llm.engine)
    monkeypatch.undo()
    assert len(watch.failed) == 1 and watch.restored == [True]
    assert BAD in [s.request_id for s in watch.failed[0].scheduled]
    return outs, watch.failed[0]


def _assert_isolated(llm: LLM, outs: dict, clean: dict) -> None:
    assert set(outs) == set(clean)
    bad = outs[BAD]
    assert bad.outputs[0].finish_reason == "error" and isinstance(bad.error, RequestFailedError)
    assert "model step" in str(bad.error) and "injected forward fault" in str(bad.error)
    assert bad.outputs[0].token_ids == clean[BAD][:len(bad.outputs[0].token_ids)]
    for request_id, out in outs.items():
        if request_id != BAD:
            assert out.error is None and out.outputs[0].token_ids == clean[request_id], request_id
    engine = llm.engine
    engine.kv_manager.check_no_leaks()
    assert not engine.has_unfinished_requests()
    (ok,) = llm.generate([_prompts()["a"]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                         use_tqdm=False)  # the engine goes on
    assert ok.error is None and ok.outputs[0].token_ids == clean["a"][:3]
    engine.kv_manager.check_no_leaks()


def _poison_pair(clean: dict, index: int):
    """`poisoned` for the bad request's output token `index` at its position (no other request
    computes that token there)."""
    position, token = len(_prompts()[BAD]) + index, clean[BAD][index]
    for request_id, prompt in _prompts().items():
        tokens = prompt + clean[request_id]
        assert request_id == BAD or len(tokens) <= position or tokens[position] != token

    def poisoned(input_ids, positions):
        return bool(((positions == position) & (input_ids == token)).any())

    return poisoned


# ---- the tests ----------------------------------------------------------------------------------

def test_fault_in_a_step_with_a_chunk_over_its_window_fails_one_request(plain, clean, monkeypatch):
    outs, failed = _run_faulty(plain, monkeypatch, lambda ids, pos: bool(((pos == 0) & (ids == POISON)).any()))
    assert outs[BAD].outputs[0].token_ids == []
    ring = plain.engine.runner.groups[0].rows_per_unit
    # a chunk whose stores (row pos mod S) reached rows of its window (positions > start - W) that it loaded
    assert any(s.start_pos > 0 and s.start_pos + s.num_tokens - 1 - ring > s.start_pos - WINDOW
               for s in failed.scheduled)
    _assert_isolated(plain, outs, clean)


def test_fault_in_a_decode_step_fails_one_request(plain, clean, monkeypatch):
    outs, failed = _run_faulty(plain, monkeypatch, _poison_pair(clean, 3))
    assert all(s.num_tokens == 1 for s in failed.scheduled) and len(failed.scheduled) == 4
    assert outs[BAD].outputs[0].token_ids == clean[BAD][:4]  # its 4th token was sampled, never fed
    _assert_isolated(plain, outs, clean)


def test_fault_in_a_verification_step_fails_one_request(spec, clean, monkeypatch):
    outs, failed = _run_faulty(spec, monkeypatch, _poison_pair(clean, 1))  # while b and c verify too
    assert sum(s.verify for s in failed.scheduled) >= 2
    assert next(s for s in failed.scheduled if s.request_id == BAD).verify
    assert len(outs[BAD].outputs[0].token_ids) <= 2
    _assert_isolated(spec, outs, clean)
    metrics = spec.get_metrics()
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics["spec_decode_num_draft_tokens"]


def test_overwritten_window_is_what_a_chunk_loads_then_stores_over():
    from deepinfer.worker.step_undo import overwritten_window

    for window, ring in ((8, 9), (8, 14), (4, 12)):
        for start in range(30):
            for n in range(1, 40):
                loads = range(max(0, start - window + 1), start)
                stored = {q % ring for q in range(max(start, start + n - ring), start + n)}
                want = [x for x in loads if x % ring in stored]
                assert list(overwritten_window(start, n, window, ring)) == want, (window, ring, start, n)
