"""LLaVA-OneVision (SigLIP tower, Qwen2 decoder) and LLaVA-NeXT (CLIP tower, Llama decoder): pictures at
any resolution (a base view plus a grid of tiles, unpadded to the picture's aspect, a newline row per
row; OneVision scales a grid past its anyres_max bound down) against HF transformers.

The checkpoints are picture_checkpoints.py's tiny random ones (tiles of 28 pixels, small grid
pinpoints); its two pictures (80x60 and 50x110) take grids whose unpadded shapes differ (4x6 rows,
scaled to 3x4 for OneVision, and 6x2 rows). The reference is HF's processor and greedy `generate`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from picture_checkpoints import MAX_TOKENS, QUESTION, Checkpoint, build_checkpoint, data_url, noise, two_pictures

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.multimodal import PictureInput

FAMILIES = ("llava_onevision", "llava_next")


def asked(picture) -> list[dict]:
    image = {"type": "image"} if picture is None else {"type": "image", "image": picture}
    return [image, {"type": "text", "text": QUESTION}]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return build_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def references(checkpoint) -> dict:
    """HF's greedy (ids, text) for each of the two pictures asked about alone, and for no picture."""
    answers = {k: checkpoint.hf_answer(asked(None), [p]) for k, p in enumerate(two_pictures())}
    answers["text"] = checkpoint.hf_answer([{"type": "text", "text": QUESTION}], [])
    return answers


@pytest.fixture(scope="module")
def llm(checkpoint):
    from deepinfer import LLM

    return LLM(checkpoint.path, dtype="float32", block_size=8, num_blocks=64, max_model_len=256, max_num_seqs=4)


def _params():
    from deepinfer import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _processed(checkpoint, picture) -> dict:
    """HF's processor on a one-picture question: input_ids, pixel_values [1, P, 3, S, S], image_sizes."""
    text = checkpoint.tokenizer.apply_chat_template([{"role": "user", "content": asked(None)}], tokenize=False,
                                                    add_generation_prompt=True)
    return dict(checkpoint.processor(text=[text], images=[picture], return_tensors="np", add_special_tokens=False))


def test_the_pictures_decide_the_answer(references):
    assert references[0][0] != references[1][0]
    assert references["text"][0] not in (references[0][0], references[1][0])


def test_encoder_rows_equal_hf_image_features(checkpoint, llm):
    """Each picture's rows are HF's `get_image_features` (unpadded, newline rows, OneVision's scaling)."""
    model = llm.engine.runner.model
    lengths = []
    for picture in [*two_pictures(), noise(300, 200, 5)]:
        arrays = _processed(checkpoint, picture)
        extra = {k: torch.as_tensor(v) for k, v in arrays.items() if k == "batch_num_images"}  # OneVision's
        with torch.no_grad():
            want = checkpoint.model.model.get_image_features(torch.as_tensor(arrays["pixel_values"]),
                                                             torch.as_tensor(arrays["image_sizes"]),
                                                             **extra).pooler_output[0]  # [length, hidden]
            got = model.encode_pictures([PictureInput("x", 0, 1, {"pixel_values": arrays["pixel_values"],
                                                                  "image_sizes": arrays["image_sizes"]})])[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        lengths.append(got.shape[0])
    image_token = checkpoint.processor.image_token_id
    assert lengths[:2] == [int((_processed(checkpoint, p)["input_ids"] == image_token).sum()) for p in two_pictures()]
    if checkpoint.family == "llava_onevision":  # base 2x2, then 3x4 rows scaled from 4x6 (+3 newlines); 6x2 (+6)
        assert lengths[:2] == [4 + 3 * (4 + 1), 4 + 6 * (2 + 1)]
    else:  # the CLS row dropped from the base view; 4x6 (+4 newlines), 6x2 (+6)
        assert lengths[:2] == [4 + 4 * (6 + 1), 4 + 6 * (2 + 1)]


def test_generate_with_picture_inputs_matches_hf(checkpoint, llm, references):
    """`LLM.generate` with the processor's ids and each picture's arrays as a PictureInput."""
    from deepinfer import SamplingParams

    image_token = checkpoint.processor.image_token_id
    prompts = []
    for k, picture in enumerate(two_pictures()):
        arrays = _processed(checkpoint, picture)
        ids = [int(t) for t in arrays["input_ids"][0]]
        offset, length = ids.index(image_token), ids.count(image_token)
        tensors = {"pixel_values": arrays["pixel_values"], "image_sizes": arrays["image_sizes"]}
        prompts.append({"prompt_token_ids": ids, "pictures": (PictureInput(f"picture-{k}", offset, length, tensors),)})
    assert prompts[0]["pictures"][0].length != prompts[1]["pictures"][0].length
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for k, out in enumerate(outputs):
        got, want = list(out.outputs[0].token_ids), references[k][0]
        assert got[:len(want)] == want, k


def test_llm_chat_answers_as_hf_for_pictures_of_two_shapes(llm, references):
    outputs = llm.chat([[{"role": "user", "content": asked(p)}] for p in two_pictures()], _params(), use_tqdm=False)
    assert len(outputs[0].prompt_token_ids) != len(outputs[1].prompt_token_ids)
    for k, out in enumerate(outputs):
        assert (list(out.outputs[0].token_ids), out.outputs[0].text) == references[k], k


def test_llm_chat_two_pictures_in_one_message(checkpoint, llm):
    first, second = two_pictures()
    content = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "?"}]
    want = checkpoint.hf_answer(content, [first, second])
    content[0]["image"], content[2]["image"] = first, second
    out = llm.chat([{"role": "user", "content": content}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == want


def test_llm_chat_a_large_picture(checkpoint, llm):
    picture = noise(300, 200, 5)
    want = checkpoint.hf_answer(asked(None), [picture])
    out = llm.chat([{"role": "user", "content": asked(picture)}], _params(), use_tqdm=False)[0]
    assert (list(out.outputs[0].token_ids), out.outputs[0].text) == want


def test_prefix_cache_a_b_a_b(checkpoint, llm):
    """A, B, A, B: each its own answer; the repeats read their own picture's cached blocks."""
    pictures = [noise(80, 60, 3), noise(80, 60, 4)]  # the same shape: the same placeholder run
    want = [checkpoint.hf_answer(asked(None), [p])[0] for p in pictures]
    assert want[0] != want[1]
    cached = []
    for k in (0, 1, 0, 1):
        out = llm.chat([{"role": "user", "content": asked(pictures[k])}], _params(), use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == want[k], k
        cached.append(out.num_cached_tokens)
    first_picture = out.prompt_token_ids.index(checkpoint.processor.image_token_id)
    assert cached[1] <= first_picture and cached[2] > first_picture and cached[3] > first_picture


def test_server_answers_as_hf(checkpoint, references):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "entrypoints"))
    from app_server import AppServer

    with AppServer("--model", checkpoint.path, "--served-model-name", "tiny", "--dtype", "float32",
                   "--max-model-len", "256") as app:
        for k, picture in enumerate(two_pictures()):
            answer = app.openai().chat.completions.create(
                model="tiny", max_tokens=MAX_TOKENS, temperature=0,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture)}},
                                                       {"type": "text", "text": QUESTION}]}])
            assert answer.choices[0].message.content == references[k][1], k


def test_field_defaults_are_transformers():
    from transformers import LlavaNextConfig, LlavaOnevisionConfig

    from deepinfer.model_executor.models.llava_next import LlavaNextConfigFields, LlavaOnevisionConfigFields

    for ours, theirs in ((LlavaNextConfigFields(), LlavaNextConfig()), (LlavaOnevisionConfigFields(),
                                                                        LlavaOnevisionConfig())):
        names = set(type(ours).__dataclass_fields__) - set(HFConfigFields.__dataclass_fields__) - {
            "image_grid_pinpoints"}  # transformers fills a default grid in; ours reads the config's
        assert {n: getattr(ours, n) for n in names} == {n: getattr(theirs, n) for n in names}


def test_bad_inputs_are_refused(llm):
    model = llm.engine.runner.model
    pixels = np.zeros((1, 2, 3, 28, 28), dtype=np.float32)
    with pytest.raises(ValueError, match="image_sizes"):
        model.encode_pictures([PictureInput("x", 0, 1, {"pixel_values": pixels})])
    with pytest.raises(ValueError, match="pixel_values.*base view"):  # a 80x60 picture needs 1 + 3x3 views
        model.encode_pictures([PictureInput("x", 0, 1, {"pixel_values": pixels, "image_sizes": np.array([[60, 80]])})])


def test_vision_aspect_ratio_is_checked():
    from deepinfer.model_executor.models.llava_next import max_views

    assert max_views("anyres_max_9") == 9
    with pytest.raises(ValueError, match="vision_aspect_ratio='anyres'"):
        max_views("anyres")


def test_hub_checkpoint_names_are_read():
    """The Hub's layouts (the tower's `vision_model.` level, the newer `model.` prefix) map onto ours;
    SigLIP's unused pooling head is left out."""
    from deepinfer.model_executor.models.llava_next import _tower_level_dropped

    names = ["vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "model.image_newline",
             "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
             "vision_tower.vision_model.head.probe", "image_newline", "language_model.model.norm.weight"]
    assert [n for n, _ in _tower_level_dropped((n, None) for n in names)] == [
        "vision_tower.encoder.layers.0.mlp.fc1.weight", "image_newline",
        "vision_tower.embeddings.patch_embedding.weight", "image_newline", "language_model.model.norm.weight"]
