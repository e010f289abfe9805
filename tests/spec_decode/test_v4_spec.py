"""Speculative decoding on DeepSeek-V4 (sliding, CSA and HCA layers): greedy identity with
scripted, n-gram and MTP drafts; rollback of the compressor state when drafts are rejected; and
the engine's cached MTP chain against the module's stateless reference."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from spec_helpers import ScriptedDrafter, mixed, run_engine

from deepinfer import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models", "deepseek_v4"))
from v4_tiny import CSA, HCA, M_CSA, SLIDING, VOCAB, make_tiny_v4  # noqa: E402

pytestmark = [pytest.mark.parity]

K = 3
# max_model_len 75: what 24 blocks of 2 rows hold for one request (compressed and index groups together)
ENGINE = dict(block_size=2, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=75)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("v4-spec"))
    make_tiny_v4(path, [SLIDING, CSA, HCA])
    return path


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    phrase = [rng.randrange(3, VOCAB) for _ in range(7)]
    return [phrase * 3, [rng.randrange(3, VOCAB) for _ in range(13)], phrase[:3] * 3]


def _greedy(n: int = 30) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _scripted(llm: LLM, prompts, truth, wrong) -> ScriptedDrafter:
    drafter = ScriptedDrafter({tuple(p): truth[i] for i, p in enumerate(prompts)}, K, VOCAB, wrong)
    llm.engine.runner.steps.drafter = drafter
    return drafter


def test_scripted_drafts_keep_greedy_output_with_preemption_and_abort(v4_path):
    prompts = _prompts()
    plain_llm = LLM(v4_path, **ENGINE)
    truth = run_engine(plain_llm, prompts, _greedy())
    plain = run_engine(plain_llm, prompts, _greedy(), abort=1)
    llm = LLM(v4_path, speculative_method="ngram", num_speculative_tokens=K, **ENGINE)
    _scripted(llm, prompts, truth, mixed)
    assert run_engine(llm, prompts, _greedy(), abort=1) == plain
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics["spec_decode_num_draft_tokens"]


def test_mtp_drafts_keep_greedy_output(v4_path):
    """MTP with seeded dummy weights: its drafts are mostly wrong, verification keeps the output."""
    prompts = _prompts(1)
    plain = run_engine(LLM(v4_path, load_format="dummy", **ENGINE), prompts, _greedy(), abort=2)
    llm = LLM(v4_path, load_format="dummy", speculative_method="mtp", num_speculative_tokens=K, **ENGINE)
    assert any(g.name == "mtp" and g.is_ring for g in llm.engine.runner.groups)
    assert run_engine(llm, prompts, _greedy(), abort=2) == plain
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


def _compressor_states(engine, request_id: str, into: dict) -> None:
    """num_tokens -> every bank's valid state of the request's slot (open window, half A)."""
    if not engine.kv_manager.has_request(request_id):
        return
    slot = engine.kv_manager.state_ids(request_id)[0]
    banks = engine.runner.model.state_banks
    n = banks[0].num_tokens[slot]
    into[n] = [torch.cat([b.kv[slot][:n % b.kv.shape[1]].flatten(), b.score[slot][:n % b.kv.shape[1]].flatten(),
                          b.prev_a_kv[slot].flatten(), b.prev_a_score[slot].clamp_min(-1e9).flatten()])
               for b in banks]


@pytest.mark.parametrize("wrong", [None, lambda *_: True], ids=["all-accepted", "all-rejected"])
def test_compressor_state_after_each_step_equals_plain_decoding(v4_path, wrong):
    prompt = _prompts(2)[1][:10]  # m = 4 and 8: verification steps open and close windows
    plain_llm = LLM(v4_path, **ENGINE)
    rid = "r"
    plain_states, spec_states = {}, {}
    plain_llm.engine.add_request(prompt, _greedy(), request_id=rid)
    truth = _drive(plain_llm, lambda e: _compressor_states(e, rid, plain_states))
    llm = LLM(v4_path, speculative_method="ngram", num_speculative_tokens=K, **ENGINE)
    _scripted(llm, [prompt], {0: truth}, wrong)
    llm.engine.add_request(prompt, _greedy(), request_id=rid)
    assert _drive(llm, lambda e: _compressor_states(e, rid, spec_states)) == truth
    metrics = llm.get_metrics()
    if wrong is None:
        assert metrics["spec_decode_num_accepted_tokens"] == metrics["spec_decode_num_draft_tokens"] > 20
    else:
        assert metrics["spec_decode_num_accepted_tokens"] == 0 < metrics["spec_decode_num_draft_tokens"]
    assert len(spec_states) > 5 and set(spec_states) <= set(plain_states)
    assert any(n % M_CSA for n in spec_states)  # compared with windows left open, too
    for n, states in spec_states.items():
        for got, want in zip(states, plain_states[n], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    llm.engine.kv_manager.check_no_leaks()


def _drive(llm: LLM, on_step) -> list[int]:
    """Run the engine's one request to the end, calling on_step after every step."""
    tokens = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens = out.outputs[0].token_ids
        on_step(llm.engine)
    return tokens


def test_cached_mtp_chain_equals_the_stateless_reference(v4_path):
    """Every step's drafts equal `DeepseekV4MTP.propose` run statelessly over the whole sequence
    (the main model's streams of all kept positions, collected step by step)."""
    llm = LLM(v4_path, load_format="dummy", speculative_method="mtp", num_speculative_tokens=K,
              speculative_draft_length="fixed", **ENGINE)
    runner, model = llm.engine.runner, llm.engine.runner.model
    drafter, streams, checks = runner.steps.drafter, [], []

    def propose(inputs, samples):
        (s, start), = inputs.spans
        new = samples.get(s.request_id)
        kept = len(new) if s.verify else s.num_tokens
        streams.append(model.last_streams[start:start + kept].clone())
        drafts = drafter.propose(inputs, samples)
        if new:
            history = s.prompt_token_ids + s.output_token_ids + [r.token_id for r in new]
            checks.append((history, drafts.get(s.request_id, [])))
        return drafts

    runner.steps.drafter = type("Recording", (), {"propose": staticmethod(propose), "release": drafter.release,
                                             "draft_probs": drafter.draft_probs, "runs_model": drafter.runs_model})()
    prompt = _prompts(3)[1] + [5] * 9  # 22 tokens: two prefill chunks, then decoding past the window
    llm.generate([prompt], _greedy(16), use_tqdm=False)
    assert len(checks) >= 5
    for history, drafts in checks:
        seen = torch.cat(streams)[:len(history) - 1]  # [T, N, hidden] of positions 0 .. T-1
        want = model.mtp.propose(model, history[:seen.shape[0] + 1], len(drafts), seen) if drafts else []
        assert drafts == want, (len(history), drafts, want)
        if not drafts:
            assert len(history) - len(prompt) >= 15  # only when max_tokens leaves no room


def test_mtp_refused_without_mtp_weights(v4_path):
    with pytest.raises(ValueError, match="MTP weights"):
        LLM(v4_path, speculative_method="mtp", **ENGINE)
