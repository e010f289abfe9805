"""Gemma 3 with pictures (models/gemma3_vision.py) against HF transformers' Gemma3ForConditionalGeneration.

A tiny random checkpoint (`save_pretrained`, so the nested config and the checkpoint names go
through our loader): a 2-layer decoder (one sliding layer of window 8, one global), a 2-layer
SigLIP tower over 56x56 pixels in 7x7 patches (an 8x8 grid avg-pooled to 4x4 = 16 rows), weights
drawn large enough that a picture decides the answer. The model runs through the engine's own
cache and step metadata (`build_step_inputs`), the picture rows given as the engine will give them.

HF lets a picture's placeholder run see itself both ways in the prefill when `token_type_ids` are
passed; ours does too (AttentionMetadata.horizons), so the reference below is HF's bidirectional
forward, and a test measures how far the causal reading would be from it.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.multimodal import PictureInput
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.ops.addressing import run_horizons
from deepinfer.model_executor.models.registry import get_model_class
from deepinfer.worker.input_batch import build_step_inputs

VOCAB = 49152  # the default model's tokenizer
IMAGE_TOKEN = 49000
RUN = 16  # mm_tokens_per_image
SIZE = 56


def _hf_config():
    import transformers as tf

    text = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                               max_position_embeddings=1024, rms_norm_eps=1e-6, final_logit_softcapping=10.0)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=SIZE, patch_size=7, vision_use_head=False)
    return tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=RUN,
                           image_token_index=IMAGE_TOKEN)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(directory, HF model): a tiny random Gemma3ForConditionalGeneration saved with save_pretrained."""
    import os
    import shutil

    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    hf = Gemma3ForConditionalGeneration(_hf_config()).eval()
    with torch.no_grad():  # larger than the default init: logits far from uniform, pictures matter
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("tiny-gemma3-vision")
    hf.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return str(path), hf


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint[0], num_blocks=32, block_size=8, max_model_len=256, max_num_seqs=2)


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(seed))  # [1, 3, S, S]


def _picture(pixels: torch.Tensor, offset: int) -> PictureInput:
    digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
    return PictureInput(digest, offset, RUN, {"pixel_values": pixels})


def _prompt(seeds=(1, 2)):
    """Text, picture, text, picture, text: ids [L] and the two PictureInputs."""
    head, middle, tail = [5, 17, 300], [900, 41, 7, 2000], [66, 1234, 8, 99, 3000]
    ids = head + [IMAGE_TOKEN] * RUN + middle + [IMAGE_TOKEN] * RUN + tail
    first, second = len(head), len(head) + RUN + len(middle)
    return ids, [_picture(_pixels(seeds[0]), first), _picture(_pixels(seeds[1]), second)]


def _hf_logits(hf, ids, pictures, bidirectional=True) -> torch.Tensor:
    """HF's logits [L, V] of a whole-sequence forward; `bidirectional`: token_type_ids mark the runs."""
    input_ids = torch.tensor([ids])  # [1, L]
    pixels = torch.cat([p.tensors["pixel_values"] for p in pictures])  # [n, 3, S, S]
    types = (input_ids == IMAGE_TOKEN).long() if bidirectional else None  # [1, L]
    with torch.no_grad():
        return hf(input_ids=input_ids, pixel_values=pixels, token_type_ids=types, use_cache=False).logits[0]


def _picture_rows(pictures, embeds, start: int, n: int):
    """(rows, embeds) of the picture positions inside [start, start + n) on a one-request step."""
    rows, parts = [], []
    for p, e in zip(pictures, embeds, strict=True):
        lo, hi = max(p.offset, start), min(p.end, start + n)
        if lo < hi:
            rows += range(lo - start, hi - start)
            parts.append(e[lo - p.offset:hi - p.offset])
    return (torch.tensor(rows, dtype=torch.long), torch.cat(parts)) if rows else None


@torch.inference_mode()
def _run(llm, ids, pictures, cuts, table, state, decode=0) -> tuple[torch.Tensor, list[int]]:
    """Our logits [L, V] of the prompt computed in prefill chunks cut at `cuts`, then `decode`
    greedy tokens decoded one step at a time: (prompt logits, greedy tokens)."""
    runner = llm.engine.runner
    model = runner.model
    embeds = model.encode_pictures(pictures)
    bounds = [0, *cuts, len(ids)]
    logits, seq, greedy = [], list(ids), []
    for start, end in zip(bounds, bounds[1:], strict=False):
        logits.append(_step(runner, ScheduledRequest("r", seq[start:end], start, (table,), (state,)),
                            _picture_rows(pictures, embeds, start, end - start)))
    logits = torch.cat(logits)  # [L, V]
    last = logits[-1]  # [V]
    for _ in range(decode):
        greedy.append(int(last.argmax()))
        seq.append(greedy[-1])
        last = _step(runner, ScheduledRequest("r", seq[-1:], len(seq) - 1, (table,), (state,)), None)[-1]
    return logits, greedy


def _step(runner, step, picture_rows) -> torch.Tensor:
    inputs = build_step_inputs(StepPlan([step]), runner.caches.addressing, runner.device)
    with forward_context(inputs.attn_metadata):
        hidden = runner.model(inputs.input_ids, inputs.positions, picture_rows)  # [T, hidden]
    return runner.model.compute_logits(hidden).float()  # [T, V]


def _hf_greedy(hf, ids, pictures, n: int) -> list[int]:
    """n greedy tokens from HF's whole-sequence forwards (the runs bidirectional, the rest causal)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_hf_logits(hf, seq, pictures)[-1].argmax()))
    return seq[len(ids):]


def test_registry_and_capabilities(llm):
    cls = get_model_class("gemma3")
    assert cls.__name__ == "Gemma3ForConditionalGeneration" and cls.capabilities.pictures
    assert type(llm.engine.runner.model) is cls
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == [8, None]


def test_picture_rows_match_transformers(llm, checkpoint):
    """encode_pictures = HF get_image_features (tower, pooling, soft-emb norm, projection), two pictures."""
    _, pictures = _prompt()
    with torch.no_grad():
        got = llm.engine.runner.model.encode_pictures(pictures)
        ref = checkpoint[1].get_image_features(torch.cat([p.tensors["pixel_values"] for p in pictures])).pooler_output
    assert len(got) == 2 and got[0].shape == (RUN, 64)
    torch.testing.assert_close(torch.stack(got), ref, atol=1e-5, rtol=1e-5)
    assert (got[0] - got[1]).abs().max() > 0.1  # two pictures, two different runs


@pytest.mark.parametrize("cuts", [(), (21,), (3, 23, 40)], ids=["one-chunk", "two-chunks", "four-chunks"])
def test_prompt_logits_match_transformers(llm, checkpoint, cuts):
    """Every prompt row's logits = HF's bidirectional forward, whole or in chunks that never cut a
    run (the second chunk re-reads the first picture's rows from the cache and the ring)."""
    ids, pictures = _prompt()
    got, _ = _run(llm, ids, pictures, list(cuts), list(range(8)), 0)
    ref = _hf_logits(checkpoint[1], ids, pictures)  # [L, V]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_match_transformers(llm, checkpoint):
    """8 greedy tokens (prefill in two chunks, then decode steps) = HF's greedy tokens; the causal
    reading of the runs would give another first token, so this tells the two apart."""
    ids, pictures = _prompt()
    _, ours = _run(llm, ids, pictures, [21], list(range(8, 16)), 1, decode=8)
    assert ours == _hf_greedy(checkpoint[1], ids, pictures, 8)
    assert ours[0] != int(_hf_logits(checkpoint[1], ids, pictures, bidirectional=False)[-1].argmax())


def test_pictures_decide_the_answer(llm, checkpoint):
    """Other pictures, same text: other greedy tokens (ours and HF's alike)."""
    ids, pictures = _prompt((1, 2))
    _, other = _prompt((3, 4))
    _, a = _run(llm, ids, pictures, [], list(range(16, 24)), 0, decode=6)
    _, b = _run(llm, ids, other, [], list(range(16, 24)), 0, decode=6)
    assert a != b
    assert b == _hf_greedy(checkpoint[1], ids, other, 6)


def test_bidirectional_runs_differ_from_causal(llm, checkpoint):
    """HF's bidirectional and causal readings differ measurably on this model, and ours is the
    bidirectional one (text rows before the first picture are the same in both)."""
    ids, pictures = _prompt()
    hf = checkpoint[1]
    both, causal = _hf_logits(hf, ids, pictures), _hf_logits(hf, ids, pictures, bidirectional=False)
    first = pictures[0].offset
    assert torch.equal(both[:first], causal[:first]) or torch.allclose(both[:first], causal[:first], atol=1e-6)
    gap = (both[first:] - causal[first:]).abs().max()
    assert gap > 0.05, float(gap)
    got, _ = _run(llm, ids, pictures, [], list(range(24, 32)), 0)
    assert (got - both).abs().max() < 2e-4 < (got - causal).abs().max()


def test_picture_input_is_checked(llm):
    model = llm.engine.runner.model
    good = _pixels(1)
    with pytest.raises(ValueError, match=r"pictures\[0\].length=3"):
        model.encode_pictures([PictureInput("h", 0, 3, {"pixel_values": good})])
    with pytest.raises(ValueError, match=r"pictures\[1\].tensors\['pixel_values'\] has shape \(1, 3, 28, 28\)"):
        model.encode_pictures([_picture(good, 0), PictureInput("h", 20, RUN, {"pixel_values": good[..., :28, :28]})])
    with pytest.raises(ValueError, match="has no 'pixel_values'"):
        model.encode_pictures([PictureInput("h", 0, RUN, {})])


def test_run_horizons():
    """A run sees up to its last position; runs end at gaps and at a request's first row."""
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 10, 11, 12])  # two requests: rows 0-5, rows 6-8
    rows = torch.tensor([7, 1, 2, 4, 5, 6])  # runs {1, 2}, {4, 5}, {6, 7}: row 6 starts request 2
    got = run_horizons(positions, rows, breaks=torch.tensor([0, 6]))
    assert got.tolist() == [0, 2, 2, 3, 5, 5, 11, 11, 12]
    assert run_horizons(positions, torch.tensor([], dtype=torch.long)).tolist() == positions.tolist()


@pytest.mark.parametrize("budget", [64, 17])
def test_generate_with_pictures_end_to_end(checkpoint, budget):
    """Through the offline API (prompt ids + PictureInput): the engine's greedy tokens = HF's. With a
    budget of 17 tokens a plain chunking would cut both runs of 16 ([0, 17), [17, 34), ...); the
    scheduler keeps each run whole in one chunk: [0, 3), [3, 19), [19, 23), [23, 39), [39, 44)."""
    ids, pictures = _prompt()
    llm = LLM(checkpoint[0], num_blocks=32, block_size=8, max_model_len=256, max_num_seqs=2,
              max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids, "pictures": tuple(pictures)}], params, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == _hf_greedy(checkpoint[1], ids, pictures, 8)


def test_a_run_longer_than_the_budget_is_refused(checkpoint):
    """A run that can never fit one chunk is refused at once, naming the option."""
    ids, pictures = _prompt()
    llm = LLM(checkpoint[0], num_blocks=32, block_size=8, max_model_len=256, max_num_batched_tokens=12)
    with pytest.raises(ValueError, match="max_num_batched_tokens=12"):
        llm.generate([{"prompt_token_ids": ids, "pictures": tuple(pictures)}], SamplingParams(max_tokens=2),
                     use_tqdm=False)


def test_prefix_cache_keys_pictures_with_sliding_windows(checkpoint):
    """Picture A, B, A, B with the same text, prefix caching on (ring snapshots: Gemma 3's sliding
    layers): each answer is its own picture's, the repeats hit the cache past their runs, and no
    prefill stops inside a run (a snapshot boundary inside one is dropped)."""
    ids, _ = _prompt()
    a = [_picture(_pixels(1), 3), _picture(_pixels(2), 23)]
    b = [_picture(_pixels(3), 3), _picture(_pixels(4), 23)]
    want = {"a": _hf_greedy(checkpoint[1], ids, a, 4), "b": _hf_greedy(checkpoint[1], ids, b, 4)}
    assert want["a"] != want["b"]
    llm = LLM(checkpoint[0], num_blocks=64, block_size=8, max_model_len=256, max_num_seqs=2,
              enable_prefix_caching=True, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    cached = []
    for name, pictures in (("a", a), ("b", b), ("a", a), ("b", b)):
        out = llm.generate([{"prompt_token_ids": ids, "pictures": tuple(pictures)}], params, use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want[name], name
        cached.append(out.num_cached_tokens)
    assert cached[0] == 0 and cached[1] < a[0].end  # B shares at most the text before its first run
    assert cached[2] >= a[1].end and cached[3] >= b[1].end  # the repeats hit past both runs
