"""`LLM.embed`: parity with sentence-transformers on tiny checkpoints (mean, last-token and CLS
pooling, chunked prefill), embeddings and generations in the same engine steps, preemption, aborts,
faults, and the requests it refuses."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_models import cosines, make_st_checkpoint, st_inputs, st_reference

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.pooling import PoolingParams

pytestmark = [pytest.mark.parity]

BUDGET = 64  # tokens per step: the longest inputs (~230 tokens) are computed in 4 chunks
MODES = {"mean": "llama", "lasttoken": "qwen3", "cls": "llama"}  # Pooling mode -> the decoder under it


@pytest.fixture(scope="module")
def st_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("st")
    return {mode: make_st_checkpoint(str(root / mode), tokenizer_dir, arch, mode) for mode, arch in MODES.items()}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return st_inputs(64)


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", max_num_batched_tokens=BUDGET, max_model_len=512, max_num_seqs=64) | kwargs
    return LLM(path, **options)


def _vectors(outputs) -> np.ndarray:
    assert all(out.finished and out.finish_reason == "stop" for out in outputs)
    return np.array([out.outputs.embedding for out in outputs], dtype=np.float64)


@pytest.mark.parametrize("mode", list(MODES))
def test_embed_matches_sentence_transformers(st_dirs, texts, mode):
    """64 inputs of mixed lengths in one call, the longest in several chunks: each vector is
    sentence-transformers' (fp32); the same bits under another chunk budget and batch size."""
    ref = st_reference(st_dirs[mode], texts)
    with _llm(st_dirs[mode]) as llm:
        outs = llm.embed(texts, use_tqdm=False)
    ours = _vectors(outs)
    assert max(len(out.prompt_token_ids) for out in outs) > 3 * BUDGET
    assert cosines(ours, ref).min() >= 0.9999
    np.testing.assert_allclose(ours, ref, atol=1e-5)  # measured: < 4e-7
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    with _llm(st_dirs[mode], max_num_batched_tokens=37, max_num_seqs=5) as llm:
        assert np.array_equal(_vectors(llm.embed(texts, use_tqdm=False)), ours)


def test_pooling_override_and_token_id_prompts(st_dirs, texts):
    """`pooling="cls"` on the mean checkpoint (same weights as the cls one) gives the cls vectors;
    prompts as token ids or dicts embed as their text does."""
    ref = st_reference(st_dirs["cls"], texts[:8])
    with _llm(st_dirs["mean"], pooling="cls") as llm:
        assert llm.engine.pooling.source == "--pooling cls"
        outs = llm.embed(texts[:8], use_tqdm=False)
        assert cosines(_vectors(outs), ref).min() >= 0.9999
        ids = [out.prompt_token_ids for out in outs]
        again = llm.embed(ids[:4] + [{"prompt_token_ids": i} for i in ids[4:]], use_tqdm=False)
        assert np.array_equal(_vectors(again), _vectors(outs))


def _record_plans(llm, monkeypatch) -> list:
    plans, execute = [], llm.engine.runner.execute

    def recording(plan):
        plans.append(plan)
        return execute(plan)

    monkeypatch.setattr(llm.engine.runner, "execute", recording)
    return plans


@pytest.mark.parametrize("num_blocks", [None, 20])
def test_embeddings_and_generations_share_steps(st_dirs, texts, monkeypatch, num_blocks):
    """Embedding and greedy generation requests in the same steps (and, with 20 blocks, preempting
    one another): the tokens and the vectors are those of each kind alone; no block is left behind."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [texts[i] for i in (3, 60, 10, 62)]
    extra = {} if num_blocks is None else {"num_blocks": num_blocks, "max_model_len": 256}
    with _llm(st_dirs["mean"], **extra) as llm:
        tokens_alone = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
        vectors_alone = _vectors(llm.embed(texts[55:64], use_tqdm=False))
        plans, engine = _record_plans(llm, monkeypatch), llm.engine
        gen_ids = [engine.add_request(p, greedy) for p in prompts[:2]]
        emb_ids = [engine.add_request(t, PoolingParams()) for t in texts[55:64]]
        gen_ids += [engine.add_request(p, greedy) for p in prompts[2:]]
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
        assert [finals[rid].outputs[0].token_ids for rid in gen_ids] == tokens_alone
        assert np.array_equal(_vectors([finals[rid] for rid in emb_ids]), vectors_alone)
        mixed = [p for p in plans if any(s.pooling for s in p.scheduled) and any(s.do_sample for s in p.scheduled)]
        assert mixed, "no step held both kinds"
        if num_blocks is not None:
            assert engine.get_metrics()["num_preemptions"] > 0
        engine.kv_manager.check_no_leaks()


def test_a_step_run_again_after_a_fault_pools_each_chunk_once(st_dirs, texts, monkeypatch):
    """A fault after the forward of a step holding a mid-prompt embedding chunk: the engine runs its
    requests again one by one, and the vector is the one of a clean run, bit for bit."""
    with _llm(st_dirs["mean"]) as llm:
        clean = _vectors(llm.embed([texts[60]], use_tqdm=False))
        runner, faults = llm.engine.runner, []
        finish = runner.caches.prefix.finish

        def failing_finish(plan):
            if not faults and len(plan.scheduled) > 1 and any(s.pooling and s.start_pos for s in plan.scheduled):
                faults.append(plan)
                raise RuntimeError("injected fault after the forward")
            return finish(plan)

        monkeypatch.setattr(runner.caches.prefix, "finish", failing_finish)
        engine = llm.engine
        emb = engine.add_request(texts[60], PoolingParams())
        gen = engine.add_request(texts[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
        assert faults and finals[gen].outputs[0].finish_reason == "length"
        assert np.array_equal(_vectors([finals[emb]]), clean)
        engine.kv_manager.check_no_leaks()


def test_abort_truncation_matryoshka_and_refusals(st_dirs, texts):
    with _llm(st_dirs["mean"]) as llm:
        engine = llm.engine
        rid = engine.add_request(texts[62], PoolingParams())
        engine.step()  # its first chunk only
        assert engine.abort_request(rid)
        (out,) = [o for o in engine.step() if o.request_id == rid]
        assert (out.finish_reason, out.outputs.embedding) == ("abort", [])
        engine.kv_manager.check_no_leaks()

        ids = llm.embed(texts[62], use_tqdm=False)[0].prompt_token_ids
        cut = llm.embed(texts[62], truncate_prompt_tokens=10, use_tqdm=False)[0]
        assert cut.prompt_token_ids == ids[-10:]
        assert cut.outputs.embedding == llm.embed([ids[-10:]], use_tqdm=False)[0].outputs.embedding

        with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt is empty"):
            llm.embed(["fine", []], use_tqdm=False)
        with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt has 600 tokens, but max_model_len is 512"):
            llm.embed([[5] * 600], use_tqdm=False)
        assert len(llm.embed([[5] * 512], use_tqdm=False)[0].outputs.embedding) == 64  # a whole context fits
        with pytest.raises(ValueError, match=r"^prompts\[0\]: prompt token id 49152 is outside the vocabulary"):
            llm.embed([[5, 49152]], use_tqdm=False)
        with pytest.raises(ValueError, match=r"^prompts\[0\]: dimensions=16: this model does not declare"):
            llm.embed(["a"], PoolingParams(dimensions=16), use_tqdm=False)
        with pytest.raises(ValueError, match="pooling_params must be a PoolingParams"):
            llm.embed(["a"], SamplingParams(), use_tqdm=False)
        engine.kv_manager.check_no_leaks()

    ref = st_reference(st_dirs["mean"], texts[:8])
    with _llm(st_dirs["mean"], hf_overrides={"is_matryoshka": True}) as llm:
        short = _vectors(llm.embed(texts[:8], PoolingParams(dimensions=16), use_tqdm=False))
        raw = _vectors(llm.embed(texts[:8], PoolingParams(dimensions=16, normalize=False), use_tqdm=False))
    expected = ref[:, :16] / np.linalg.norm(ref[:, :16], axis=1, keepdims=True)  # cut, then renormalised
    assert short.shape == (8, 16) and cosines(short, expected).min() >= 0.9999
    np.testing.assert_allclose(short, expected, atol=1e-5)
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), short, atol=1e-6)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
