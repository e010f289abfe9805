"""Qwen2-VL and Qwen2.5-VL through the engine (`LLM.generate` with prompt ids and pictures) against
transformers' `generate`: two pictures of different sizes in one prompt, requests batched, chunked
prefill cutting the pictures' runs, preemption, and the prefix cache (M-RoPE positions of a chunk
that starts past a picture come from the request's pictures, not from the cache).

These need the engine's picture plumbing (requests carry `pictures`, the worker fills picture rows,
composite configs lifted at load) and `pictures=True` in the model's capabilities."""

from __future__ import annotations

import pytest
import torch
from qwen_vl_models import hf_inputs, hf_model, pictures, prompt_ids

from deepinfer.sampling_params import SamplingParams

MAX_TOKENS = 6


@pytest.fixture(scope="module", params=("qwen2_vl", "qwen2_5_vl"))
def checkpoint(request, tmp_path_factory):
    """(HF model, its save_pretrained directory)."""
    hf = hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    return hf, path


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], pics) -> list[int]:
    if not pics:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    else:
        out = hf.generate(**hf_inputs(ids, pics), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids):].tolist()


def _llm(path: str, **kwargs):
    from deepinfer import LLM

    options = dict(dtype="float32", block_size=8, num_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
                   max_model_len=128)
    return LLM(path, **{**options, **kwargs})


def _generate(llm, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _request(ids, pics) -> dict:
    return {"prompt_token_ids": ids, "pictures": tuple(pics)}


def test_text_only_prompt_matches_hf(checkpoint):
    hf, path = checkpoint
    ids = list(range(5, 30))
    assert _generate(_llm(path), [ids]) == [_hf_greedy(hf, ids, ())]


def test_two_pictures_batched_and_chunked_match_hf(checkpoint):
    """Two requests, each with two pictures (6 and 12 tokens); a budget of 5 tokens a step cuts the runs."""
    hf, path = checkpoint
    a, b = pictures(0), pictures(1)
    ids = prompt_ids(a)
    want = [_hf_greedy(hf, ids, a), _hf_greedy(hf, ids, b)]
    assert want[0] != want[1]  # the pictures decide the answer: the test can fail
    llm = _llm(path, max_num_batched_tokens=5, enable_prefix_caching=False)
    assert _generate(llm, [_request(ids, a), _request(ids, b)]) == want


def test_preemption_recomputes_pictures(checkpoint):
    hf, path = checkpoint
    ids = prompt_ids(pictures(0), length=38)  # decoding crosses into a sixth block of 8
    requests = [pictures(seed) for seed in (2, 3, 4)]
    want = [_hf_greedy(hf, ids, pics) for pics in requests]
    llm = _llm(path, num_blocks=10, max_num_batched_tokens=16, enable_prefix_caching=False, max_model_len=48)
    assert _generate(llm, [_request(ids, pics) for pics in requests]) == want
    assert llm.engine.get_metrics()["num_preemptions"] > 0


def test_prefix_cache_hits_keep_positions(checkpoint):
    """A, B, A, B with the same ids: each answer is its own pictures'; the repeats start past both runs."""
    hf, path = checkpoint
    a, b = pictures(5), pictures(6)
    ids = prompt_ids(a)
    want = {"a": _hf_greedy(hf, ids, a), "b": _hf_greedy(hf, ids, b)}
    llm = _llm(path)
    cached = []
    for name, pics in (("a", a), ("b", b), ("a", a), ("b", b)):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        out = llm.generate([_request(ids, pics)], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want[name], name
        cached.append(out.num_cached_tokens)
    assert cached[0] == 0 and cached[2] >= a[1].end and cached[3] >= b[1].end
