"""Qwen2-VL and Qwen2.5-VL against transformers, on tiny random checkpoints written by its
`save_pretrained`: the vision tower (two pictures of different sizes at once), the M-RoPE positions
(HF's get_rope_index), the logits of a whole prompt with pictures, and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from qwen_vl_models import CachedRequest, hf_inputs, hf_model, pictures, prompt_ids

from deepinfer.model_executor.loader.hf import load_hf_source
from deepinfer.model_executor.model_loader import build_model
from deepinfer.model_executor.models.qwen2_vl.mrope import PictureGrid, mrope_positions

KINDS = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="module", params=KINDS)
def models(request, tmp_path_factory):
    """(HF model, ours loaded from its save_pretrained directory)."""
    hf = hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    hf.save_pretrained(path)
    ours = build_model(load_hf_source(path), torch.float32, torch.device("cpu"), 256)
    return hf, ours


@torch.no_grad()
def test_vision_tower_matches_hf(models):
    hf, ours = models
    pics = pictures()
    inputs = hf_inputs(prompt_ids(pics), pics)
    ref = hf.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    got = ours.encode_pictures(pics)
    assert [tuple(g.shape) for g in got] == [(6, 64), (12, 64)]
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    alone = ours.encode_pictures(pics[1:])[0]  # a picture's rows do not depend on the others
    torch.testing.assert_close(alone, got[1], atol=1e-5, rtol=1e-5)


def test_rope_positions_match_get_rope_index(models):
    hf, ours = models
    pics = pictures()
    ids = prompt_ids(pics)
    inputs = hf_inputs(ids, pics)
    ref, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    assert torch.equal(ours.rope_positions(pics, 0, len(ids)), ref[:, 0])
    assert torch.equal(ours.rope_positions(pics, 5, 11), ref[:, 0, 5:16])  # a chunk cut inside the first picture
    decode = ours.rope_positions(pics, len(ids) + 3, 2)  # generated tokens: index + rope delta
    assert torch.equal(decode, (torch.arange(len(ids) + 3, len(ids) + 5) + int(delta)).expand(3, 2))


def test_mrope_positions_text_only_and_picture_at_end():
    assert torch.equal(mrope_positions([], 3, 4), torch.arange(3, 7).expand(3, 4))
    grid = PictureGrid(offset=2, t=1, h=2, w=3)  # the prompt ends with the picture: indices 2..7
    pos = mrope_positions([grid], 0, 10)
    assert pos[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert pos[:, 8:].tolist() == [[5, 6]] * 3  # after the run: 2 + max(2, 3), then on


def test_picture_grid_refuses_a_wrong_run_length(models):
    _, ours = models
    pic = pictures()[0]
    bad = type(pic)(pic.content_hash, pic.offset, pic.length + 1, pic.tensors)
    with pytest.raises(ValueError, match=r"pictures\[0\].*length 7"):
        ours.rope_positions([bad], 0, 4)


@torch.no_grad()
def test_prompt_logits_match_hf_forward(models):
    hf, ours = models
    pics = pictures()
    ids = prompt_ids(pics)
    ref = hf(**hf_inputs(ids, pics)).logits[0]  # [L, V]
    request = CachedRequest(ours, pics)
    got = torch.cat([request.step(ids[:9], 0), request.step(ids[9:], 9)])  # cut inside the first picture
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_greedy_tokens_match_hf_generate_and_pictures_matter(models):
    hf, ours = models
    ids = prompt_ids(pictures())
    outputs = []
    for seed in (0, 1):
        pics = pictures(seed)
        ref = hf.generate(**hf_inputs(ids, pics), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        got = CachedRequest(ours, pics).greedy(ids, 8, chunk=10)
        assert got == ref
        outputs.append(got)
    assert outputs[0] != outputs[1]  # the picture changes the answer


@pytest.mark.parametrize("grids", [((1, 4, 6), (1, 8, 6)), ((1, 10, 14), (2, 6, 4))])
def test_vision_index_arithmetic_matches_hf(grids):
    """Patch (row, col) order, and the window order and bounds (windows of 2x2 and 3x3 merged groups)."""
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    from deepinfer.model_executor.models.qwen2_vl.vision import patch_hw, window_order

    grid = torch.tensor(grids)
    assert torch.equal(patch_hw(grid, 2), get_vision_position_ids(grid, 2))
    for window in (2, 3):
        order, bounds = window_order(grid, 2, window)
        ref_order, ref_bounds = get_vision_window_index(grid, 2, window * 2 * 14, 14)
        assert torch.equal(order, ref_order) and bounds == ref_bounds.tolist()


@torch.no_grad()
def test_tied_head_checkpoint_loads_and_matches(tmp_path):
    hf = hf_model("qwen2_vl", seed=3, tie_word_embeddings=True)
    hf.save_pretrained(str(tmp_path))
    ours = build_model(load_hf_source(str(tmp_path)), torch.float32, torch.device("cpu"), 256)
    assert ours.tie_word_embeddings and not hasattr(ours, "lm_head")
    pics = pictures()
    ids = prompt_ids(pics)
    ref = hf(**hf_inputs(ids, pics)).logits[0]  # [L, V]
    torch.testing.assert_close(CachedRequest(ours, pics).step(ids, 0), ref, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_checkpoint_in_the_older_layout_loads(tmp_path):
    """Checkpoints written before transformers 5 (the Hub's Qwen2-VL / Qwen2.5-VL): decoder fields
    at the config's top level, tensors named `model.*` (decoder) and `visual.*` (tower)."""
    import json

    from safetensors.torch import load_file, save_file

    hf = hf_model("qwen2_5_vl", seed=4)
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    text = config.pop("text_config")
    config.update({k: v for k, v in text.items() if k not in ("model_type", "architectures", "rope_parameters")})
    rope = text["rope_parameters"]  # as the Hub's configs spell it
    config.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    old = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
           for name, t in tensors.items()}
    save_file(old, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = build_model(load_hf_source(str(tmp_path)), torch.float32, torch.device("cpu"), 256)
    pics = pictures()
    ids = prompt_ids(pics)
    ref = hf(**hf_inputs(ids, pics)).logits[0]  # [L, V]
    torch.testing.assert_close(CachedRequest(ours, pics).step(ids, 0), ref, atol=2e-4, rtol=1e-4)


@torch.no_grad()
def test_pictures_from_the_hf_image_processor(models):
    """Pictures as transformers' image processor gives them (one call per picture, numpy arrays)
    encode as HF's forward does, and the prompt's logits match."""
    import numpy as np
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from deepinfer.contracts.multimodal import PictureInput

    hf, ours = models
    processor = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2,
                                         size={"shortest_edge": 64, "longest_edge": 4096})
    rng = np.random.default_rng(0)
    pics, offset = [], 2
    for height, width in ((30, 45), (20, 17)):
        image = Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))
        arrays = dict(processor(images=[image], return_tensors="np"))
        length = int(arrays["image_grid_thw"].prod()) // 4
        pics.append(PictureInput(f"img{height}x{width}", offset, length, arrays))
        offset += length + 3
    ids = prompt_ids(pics, length=offset + 2)
    ref = hf(**hf_inputs(ids, pics)).logits[0]  # [L, V]
    torch.testing.assert_close(CachedRequest(ours, pics).step(ids, 0), ref, atol=2e-4, rtol=1e-4)
