"""Picture preprocessing against the HF processors themselves: two pictures of different sizes give
the processor's input_ids and pixel arrays, each picture's placeholder run at the right place."""

from __future__ import annotations

import numpy as np
import pytest
from vision_checkpoints import ANYRES, two_pictures, vision_folder

from deepinfer.serving.chat.prompt import ChatSetup, prepare_chat
from deepinfer.serving.errors import FieldError
from deepinfer.serving.pictures import OFFLINE, Picture, content_hash
from deepinfer.serving.vision import VisionProcessor

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"},
                                         {"type": "image"}]}]


def hf_processor(family: str, image_processor, tokenizer, settings: dict):
    """The family's HF processor over the same tokenizer and image processor (Qwen2-VL's, whose
    constructor wants a torchvision video processor, is assembled without it)."""
    import transformers as tf

    if family == "llava":
        return tf.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 **{k: v for k, v in settings.items() if k != "image_token"})
    if family == "llava_next":
        return tf.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, **settings)
    if family == "llava_onevision":  # its constructor wants a torchvision video processor: without it
        proc = object.__new__(tf.LlavaOnevisionProcessor)
        proc.image_processor, proc.tokenizer, proc.video_processor, proc.chat_template = (
            image_processor, tokenizer, None, None)
        proc.num_image_tokens, proc.vision_feature_select_strategy = 4, settings["vision_feature_select_strategy"]
        proc.vision_aspect_ratio = settings["vision_aspect_ratio"]
        proc.image_token, proc.video_token, proc.video_token_id = "<image>", "<video>", None
        proc.image_token_id = tokenizer.convert_tokens_to_ids("<image>")
        return proc
    if family == "gemma3":
        return tf.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, **settings)
    proc = object.__new__(tf.Qwen2VLProcessor)
    proc.image_processor, proc.tokenizer = image_processor, tokenizer
    proc.video_processor, proc.chat_template = None, None
    proc.image_token, proc.video_token, proc.video_token_id = "<|image_pad|>", "<|video_pad|>", None
    proc.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return proc


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "gemma3", "llava_next", "llava_onevision"])
def family_dir(request, tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp(request.param))
    _, image_processor, settings = vision_folder(request.param, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return request.param, path, tokenizer, hf_processor(request.param, image_processor, tokenizer, settings)


def test_ids_arrays_and_runs_match_the_hf_processor(family_dir):
    family, path, tokenizer, reference = family_dir
    vision = VisionProcessor.load(path, tokenizer)
    assert type(vision.image_processor).__name__.endswith("Pil")  # no torchvision needed
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    images = two_pictures()
    ids, pictures = vision.process(tokenizer, text, [Picture(im, content_hash(im)) for im in images])
    expected = reference(text=[text], images=images, return_tensors="np", add_special_tokens=False)
    assert ids == [int(t) for t in expected["input_ids"][0]]
    token = tokenizer.convert_tokens_to_ids({"qwen2_vl": "<|image_pad|>", "gemma3": "<image_soft_token>"}.get(
        family, "<image>"))
    positions = [i for i, t in enumerate(ids) if t == token]
    assert [p.offset for p in pictures] == [positions[0], positions[pictures[0].length]]
    assert sum(p.length for p in pictures) == len(positions)
    for p in pictures:
        assert all(ids[i] == token for i in range(p.offset, p.end))
    assert pictures[1].offset > pictures[0].end  # the text between them
    assert [p.content_hash for p in pictures] == [content_hash(im) for im in images]
    if family in ANYRES:  # each picture's own views (the batch's padding views dropped), and its size
        _check_anyres_arrays(pictures, expected)
        return
    pixels = np.concatenate([p.tensors["pixel_values"] for p in pictures])
    np.testing.assert_array_equal(pixels, expected["pixel_values"])
    if family == "qwen2_vl":  # patches of different counts per picture, and a grid each
        np.testing.assert_array_equal(np.concatenate([p.tensors["image_grid_thw"] for p in pictures]),
                                      expected["image_grid_thw"])
        assert pictures[0].length != pictures[1].length
        assert [len(p.tensors["pixel_values"]) for p in pictures] == [
            int(np.prod(g)) for g in expected["image_grid_thw"]]
    else:
        assert [p.tensors["pixel_values"].shape[0] for p in pictures] == [1, 1]


def _check_anyres_arrays(pictures, expected) -> None:
    views = [p.tensors["pixel_values"].shape[1] for p in pictures]
    assert views == [5, 4]  # base view + 2x2 tiles, base view + 1x3 tiles
    assert pictures[0].length != pictures[1].length
    for k, p in enumerate(pictures):
        np.testing.assert_array_equal(p.tensors["pixel_values"], expected["pixel_values"][k:k + 1, :views[k]])
        np.testing.assert_array_equal(p.tensors["image_sizes"], expected["image_sizes"][k:k + 1])
    assert not expected["pixel_values"][1, views[1]:].any()  # what was dropped is the batch's zero padding


def test_prepare_chat_hands_over_pictures_of_openai_parts(family_dir, tmp_path):
    from PIL import Image

    _, path, tokenizer, reference = family_dir
    picture_file = tmp_path / "a.png"
    two_pictures()[1].save(picture_file)
    setup = ChatSetup(vision=VisionProcessor.load(path, tokenizer), media=OFFLINE)
    messages = [{"role": "user", "content": [{"type": "image", "image": two_pictures()[0]},
                                             {"type": "text", "text": "what is this"},
                                             {"type": "image_url", "image_url": {"url": str(picture_file)}}]}]
    chat = prepare_chat(tokenizer, setup, messages, None)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = reference(text=[text], images=[two_pictures()[0], Image.open(picture_file).convert("RGB")],
                         return_tensors="np", add_special_tokens=False)
    assert chat.prompt_ids == [int(t) for t in expected["input_ids"][0]]
    assert len(chat.pictures) == 2


def test_a_marker_typed_in_the_text_is_refused(family_dir):
    family, path, tokenizer, _ = family_dir
    marker = {"qwen2_vl": "<|image_pad|>", "gemma3": "<start_of_image>"}.get(family, "<image>")
    setup = ChatSetup(vision=VisionProcessor.load(path, tokenizer), media=OFFLINE)
    messages = [{"role": "user", "content": [{"type": "image", "image": two_pictures()[0]},
                                             {"type": "text", "text": f"what {marker}"}]}]
    with pytest.raises(FieldError) as info:
        prepare_chat(tokenizer, setup, messages, None)
    assert info.value.path == ("messages",) and "markers" in str(info.value)


def test_a_text_model_folder_has_no_vision_processor(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert VisionProcessor.load(str(tmp_path)) is None
