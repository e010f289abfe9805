"""Parallel sampling (`n`, `best_of`): siblings draw different samples (the same set again for a
seed), greedy siblings equal the single greedy output (checked against HF transformers), the
prompt's blocks are computed once and shared (with or without the prefix cache), best_of keeps
the highest cumulative logprobs (recomputed by HF), and aborts and preemption leak nothing."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import assert_teacher_forcing, hf_reference, teacher_forcing_logprobs

from deepinfer import LLM, SamplingParams
from deepinfer.engine import parallel_sampling

PROMPT = list(range(10, 70))  # 60 tokens: 15 blocks of 4
PROMPT_BLOCKS = len(PROMPT) // 4


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-cache", "no-prefix-cache"])
def llm(request, tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), num_blocks=80, block_size=4, max_num_seqs=8,
               max_num_batched_tokens=64, max_model_len=128, enable_prefix_caching=request.param)


@pytest.fixture(scope="module")
def hf_llama(tiny_checkpoint):
    return hf_reference(tiny_checkpoint("llama"))


def _run(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


# -- parameters -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field, shown", [
    ({"n": 0}, "n", "0"), ({"n": 129}, "n", "129"), ({"n": 2.0}, "n", "2.0"), ({"n": True}, "n", "True"),
    ({"n": 3, "best_of": 2}, "best_of", "2"), ({"best_of": 0}, "best_of", "0"),
    ({"best_of": "4"}, "best_of", "'4'"), ({"n": 2, "best_of": 200}, "best_of", "200"),
])
def test_bad_n_or_best_of_is_refused_naming_the_field_and_value(kwargs, field, shown):
    with pytest.raises(ValueError, match=rf"^{field} .*{shown}"):
        SamplingParams(**kwargs)


def test_num_samples_is_best_of_or_n():
    assert SamplingParams(n=3).num_samples == 3
    assert SamplingParams(n=2, best_of=5).num_samples == 5
    assert SamplingParams(n=2, best_of=None).best_of is None


def test_child_seeds_differ_and_stay_in_range():
    top = SamplingParams(n=3, seed=2**64 - 2)
    seeds = [parallel_sampling.child_params(top, i).seed for i in range(3)]
    assert seeds == [2**64 - 2, 2**64 - 1, -(2**63)]
    assert all(parallel_sampling.child_params(top, i).n == 1 for i in range(3))


# -- samples --------------------------------------------------------------------------------------


def test_samples_differ_and_a_seed_repeats_the_whole_set(llm):
    params = SamplingParams(n=4, max_tokens=6, seed=7)
    first = llm.generate(PROMPT, params, use_tqdm=False)[0]
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 4, samples
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in first.outputs)
    unseeded = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=6), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) == 3
    llm.engine.kv_manager.check_no_leaks()


def test_greedy_samples_each_equal_the_single_greedy_output(llm, hf_llama):
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    single = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0]
    assert_teacher_forcing(hf_llama, PROMPT, single.token_ids)  # the independent reference
    many = llm.generate(PROMPT, SamplingParams(n=3, max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.token_ids for c in many.outputs] == [single.token_ids] * 3
    assert [c.text for c in many.outputs] == [single.text] * 3
    llm.engine.kv_manager.check_no_leaks()


def test_the_prompt_is_computed_once_and_its_blocks_shared(llm, monkeypatch):
    """4 samples of a 15-block prompt: without sharing they would hold 4 x 15 blocks at once and
    compute the prompt 4 times."""
    engine, prompt = llm.engine, list(range(200, 260))  # a prompt no other test computed
    planned = []  # prompt tokens each step computes, from the scheduler's own plans
    real = engine.scheduler.schedule

    def schedule():
        plan = real()
        planned.append(sum(max(0, min(s.start_pos + s.num_tokens, len(prompt)) - s.start_pos)
                           for s in plan.scheduled))
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    engine.add_request(prompt, SamplingParams(n=4, max_tokens=8, ignore_eos=True), request_id="shared")
    children = engine.samples.get("shared").children
    peak, final = 0, None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
        peak = max(peak, engine.kv_manager.num_total_blocks - engine.kv_manager.num_free_blocks)
    assert peak <= PROMPT_BLOCKS + 4 * 3, peak  # the prompt once, plus a few blocks per sample
    assert final.num_cached_tokens == 0  # the prompt's own admission found nothing cached
    assert [c.num_cached_tokens for c in children] == [0] + [len(prompt) - 4] * 3  # all full blocks but the last
    assert sum(planned) == len(prompt) + 3 * 4, planned  # the prompt once, then each sibling's last 4 tokens
    engine.kv_manager.check_no_leaks()


def test_best_of_returns_the_highest_cumulative_logprobs(llm, hf_llama, monkeypatch):
    candidates = []
    real = parallel_sampling.best_completions

    def spy(completions, n):
        candidates.extend(completions)
        return real(completions, n)

    monkeypatch.setattr(parallel_sampling, "best_completions", spy)
    out = llm.generate(PROMPT, SamplingParams(n=2, best_of=5, max_tokens=5, seed=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(candidates) == 5 and len(out.outputs) == 2
    reference = {}  # token ids -> cumulative logprob under HF transformers
    for c in candidates:
        rows = teacher_forcing_logprobs(hf_llama, PROMPT, c.token_ids)  # [5, V]
        reference[tuple(c.token_ids)] = float(sum(rows[i, t] for i, t in enumerate(c.token_ids)))
        assert c.cumulative_logprob == pytest.approx(reference[tuple(c.token_ids)], abs=1e-2)
    ranked = sorted(reference.values(), reverse=True)
    got = [reference[tuple(c.token_ids)] for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1]
    assert got == pytest.approx(ranked[:2], abs=1e-2)
    assert got[0] >= got[1]
    assert all(c.delta_token_ids == c.token_ids for c in out.outputs)  # nothing was reported before


# -- streams, chat, ids -------------------------------------------------------------------------------


def test_stream_yields_every_sample_with_its_index(llm):
    deltas: dict[int, list[int]] = {0: [], 1: [], 2: []}
    last = None
    for out in llm.stream(PROMPT, SamplingParams(n=3, max_tokens=4, seed=1)):
        assert sorted(c.index for c in out.outputs) == [0, 1, 2]
        for c in out.outputs:
            deltas[c.index] += c.delta_token_ids
        last = out
    assert last.finished
    assert all(deltas[c.index] == c.token_ids and len(c.token_ids) == 4 for c in last.outputs)
    llm.engine.kv_manager.check_no_leaks()


def test_chat_returns_n_choices(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(n=2, max_tokens=3, seed=0),
                   use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 3 or c.finish_reason == "stop" for c in out.outputs)


def test_ids_of_samples_cannot_be_taken_or_aborted_alone(llm):
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=2), request_id="p")
    with pytest.raises(ValueError, match="'p' is already in use"):
        engine.add_request(PROMPT, SamplingParams(n=2), request_id="p")
    with pytest.raises(ValueError, match="'p#1' is already in use"):
        engine.add_request(PROMPT, SamplingParams(), request_id="p#1")
    assert engine.abort_request("p#0") is False
    done = _run(engine)
    assert len(done["p"].outputs) == 2
    engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id="q#0")
    with pytest.raises(ValueError, match=r"'q' is already in use \(its sample id 'q#0'"):
        engine.add_request(PROMPT, SamplingParams(n=2), request_id="q")
    assert set(_run(engine)) == {"q#0"}
    engine.kv_manager.check_no_leaks()


@pytest.mark.parametrize("num_steps", [0, 1, 2, 4])
def test_abort_mid_run_ends_every_sample_and_frees_every_block(llm, num_steps):
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(n=4, best_of=5, max_tokens=20, seed=2, ignore_eos=True),
                       request_id="gone")
    for _ in range(num_steps):
        assert not [o for o in engine.step() if o.request_id == "gone"]  # best_of: nothing until the end
    assert engine.abort_request("gone")
    outs = [o for o in engine.step() if o.request_id == "gone"]
    assert len(outs) == 1 and outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 4
    assert not engine.has_unfinished_requests()
    engine.kv_manager.check_no_leaks()
    assert engine.runner.steps.sampler.num_request_generators == 0


def test_a_failed_sample_fails_alone(llm, monkeypatch):
    """A fault in one sample's sampling ends that sample ("error", the output's `error` set);
    its siblings run to their end and every block comes back."""
    from deepinfer.model_executor.layers.sampler import Sampler

    real = Sampler.__call__

    def sample(self, logits, metadata):
        if "f#1" in metadata.request_ids:
            raise RuntimeError("injected sampler fault")
        return real(self, logits, metadata)

    monkeypatch.setattr(Sampler, "__call__", sample)
    llm.engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=4, ignore_eos=True), request_id="f")
    out = _run(llm.engine)["f"]
    assert [c.finish_reason for c in out.outputs] == ["length", "error", "length"]
    assert "injected sampler fault" in str(out.error)
    llm.engine.kv_manager.check_no_leaks()


# -- ring models, preemption ------------------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
def test_ring_model_samples_are_correct(tiny_checkpoint, caching):
    """gemma3 (sliding + global layers): siblings share through snapshots or recompute the prompt."""
    llm = LLM(tiny_checkpoint("gemma3"), num_blocks=48, block_size=4, max_num_seqs=4, kv_cache_memory="64MiB",
              max_num_batched_tokens=32, max_model_len=96, enable_prefix_caching=caching)
    prompt = PROMPT[:40]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    single = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    many = llm.generate(prompt, SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert [c.token_ids for c in many.outputs] == [single] * 3
    llm.engine.kv_manager.check_no_leaks()


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.integers(0, 2)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(1), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0), st.just(1), st.just(0)),
), min_size=1, max_size=20)


@pytest.fixture(scope="module")
def small_llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), num_blocks=16, block_size=4, max_num_seqs=4,
               max_num_batched_tokens=16, max_model_len=64, enable_prefix_caching=False)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_random_samples_with_preemption_and_aborts_leave_nothing_behind(small_llm, ops):
    """A cache too small for every sample at once: preemption (of shared blocks too), aborts
    before and after the siblings joined; every request ends with n outputs, nothing leaks."""
    engine, ids, ended = small_llm.engine, [], {}
    for op, a, b, n, extra in ops:
        if op == "add":
            params = SamplingParams(n=n, best_of=n + extra, max_tokens=b, ignore_eos=True)
            ids.append((engine.add_request(list(range(3, 3 + a)), params), n))
        elif op == "step":
            for _ in range(a):
                ended.update({o.request_id: o for o in engine.step() if o.finished})
        elif ids:
            engine.abort_request(ids[a % len(ids)][0])
    ended.update({o.request_id: o for o in engine.step() if o.finished})  # aborts report with a step
    ended.update(_run(engine))
    for request_id, n in ids:
        assert [c.index for c in ended[request_id].outputs] == list(range(n))
    engine.kv_manager.check_no_leaks()
