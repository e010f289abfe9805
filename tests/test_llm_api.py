"""The offline API on a tiny checkpoint: batching, streaming, seeds, stops, bad input, no leaks."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), num_blocks=64, block_size=8, max_model_len=128,
               max_num_batched_tokens=64)


def _no_leaks(llm):
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not llm.engine.has_unfinished_requests()


def test_generate_keeps_prompt_order_and_lengths(llm):
    prompts = [[5, 6, 7], [8] * 20, [9, 10]]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                  for n in (3, 7, 5)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7, 5]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    _no_leaks(llm)


def test_stream_deltas_sum_to_the_text(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    deltas = list(llm.stream([11, 12, 13], params))
    assert deltas[-1].finished
    assert "".join(d.outputs[0].delta_text for d in deltas) == deltas[-1].outputs[0].text
    whole = llm.generate([[11, 12, 13]], params, use_tqdm=False)[0]
    assert whole.outputs[0].token_ids == deltas[-1].outputs[0].token_ids
    _no_leaks(llm)


def test_seeded_sampling_ignores_the_rest_of_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate([[20, 21, 22]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True) for _ in range(3)]
    mixed = llm.generate([[1, 2], [20, 21, 22], [3] * 30, [4, 5]], [others[0], seeded, others[1], others[2]],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    _no_leaks(llm)


def test_stop_token_and_stop_string(llm):
    base = llm.generate([[30, 31]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = llm.generate([[30, 31]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.text == llm.get_tokenizer().decode(base.token_ids[:first])  # the stop token's text is not emitted
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate([[30, 31]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[:text.index(stop)]
    _no_leaks(llm)


@pytest.mark.parametrize("prompt, field", [([], "empty"), ([1] * 200, "max_model_len"),
                                           ([10**9], "vocabulary")])
def test_a_bad_prompt_raises_naming_its_index_before_anything_runs(llm, prompt, field):
    """As the server answers 400: a prompt the engine refuses is a ValueError naming its index, and
    the prompts queued before it are taken back (no block stays held)."""
    good = [7, 8, 9]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match=rf"^prompts\[1\]: .*{field}"):
        llm.generate([good, prompt, good], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv_manager.check_no_leaks()
    outs = llm.generate([good, good], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_max_tokens_beyond_the_context_is_refused_as_the_server_does(llm):
    """SamplingParams(max_tokens=100000) used to run to the end of the context (minutes); the server
    answered the same request with a 400."""
    limit = llm.engine.max_model_len
    with pytest.raises(ValueError, match=rf"^prompts\[0\]: max_tokens=100000 with a prompt of 3 tokens exceeds "
                                         rf"max_model_len {limit}: use max_tokens <= {limit - 3}"):
        llm.generate([[7, 8, 9]], SamplingParams(max_tokens=100000), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens=100000"):
        next(llm.stream([7, 8, 9], SamplingParams(max_tokens=100000)))
    out = llm.generate([[7, 8, 9]], SamplingParams(max_tokens=limit - 3, temperature=0), use_tqdm=False)[0]
    assert out.error is None
    llm.engine.kv_manager.check_no_leaks()
    _no_leaks(llm)


@pytest.mark.parametrize("kwargs, needle", [(dict(max_tokens=0), "max_tokens"),
                                            (dict(temperature=-0.5), "temperature"),
                                            (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
                                            (dict(bogus_field=3), "bogus_field"),
                                            (dict(seed=2**64), "seed"), (dict(seed=-2**63 - 1), "seed"),
                                            (dict(top_k=2**63), "top_k"), (dict(logprobs=10**30), "logprobs"),
                                            (dict(temperature=float("inf")), "temperature"),
                                            (dict(stop_token_ids=[2**63]), "stop_token_ids"),
                                            (dict(ignore_eos="no"), "ignore_eos"),
                                            (dict(skip_special_tokens=1), "skip_special_tokens")])
def test_bad_sampling_field_names_field_and_value(kwargs, needle):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert needle in str(err.value) and repr(next(iter(kwargs.values()))) in str(err.value)


def test_engine_refuses_bad_request_and_keeps_running(llm):
    engine = llm.engine
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    with pytest.raises(ValueError, match="prompt has 300 tokens"):
        engine.add_request([1] * 300, SamplingParams(max_tokens=5))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done[good].outputs[0].token_ids) == 5
    _no_leaks(llm)


def test_abort_while_streaming_frees_blocks(llm):
    gen = llm.stream([40, 41, 42], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    next(gen), next(gen)
    gen.close()  # the stream's owner walked away: the request is aborted
    _no_leaks(llm)


def test_missing_and_non_model_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=str(tmp_path)):
        LLM(str(tmp_path))


def test_unknown_architecture_lists_supported(tiny_checkpoint, tmp_path):
    import json
    import shutil

    path = tmp_path / "weird"
    shutil.copytree(tiny_checkpoint("llama"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported.*llama"):
        LLM(str(path))


@pytest.mark.parametrize("field", ["temperature", "seed", "top_k", "max_tokens"])
def test_huge_numbers_are_refused_with_a_short_message(field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: -10**5000})  # past Python's int -> str limit
    assert field in str(err.value) and len(str(err.value)) < 200
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: 10**400})  # too large for a float / an int64
    assert field in str(err.value) and "characters" in str(err.value) and len(str(err.value)) < 200


def test_extreme_seeds_work_and_a_seed_changed_after_validation_is_refused(llm):
    for seed in (2**64 - 1, -2**63):
        out = llm.generate([[7, 8]], SamplingParams(max_tokens=3, seed=seed, ignore_eos=True), use_tqdm=False)[0]
        assert out.error is None and len(out.outputs[0].token_ids) == 3
    params = SamplingParams(max_tokens=3)
    params.seed = 2**64
    with pytest.raises(ValueError, match=rf"prompts\[0\]: .*{2**64}"):
        llm.generate([[7, 8], [9, 10]], [params, SamplingParams(max_tokens=3, ignore_eos=True)], use_tqdm=False)
    _no_leaks(llm)


def test_interrupted_generate_leaves_nothing_scheduled(llm, monkeypatch):
    engine, real, calls = llm.engine, llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    _no_leaks(llm)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
