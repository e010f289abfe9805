"""`LLM.chat` with pictures: PIL images, local paths and data URLs in content parts, prepared as the
server prepares them (any local path allowed offline); a picture to a text model is a ValueError
naming its part."""

from __future__ import annotations

import base64
import io

import pytest
from vision_checkpoints import two_pictures, vision_folder

from deepinfer.sampling_params import SamplingParams
from deepinfer.serving.offline_chat import prepare_offline_chat, with_pictures
from deepinfer.serving.pictures import content_hash
from deepinfer.serving.vision import VisionProcessor


def test_pil_images_paths_and_data_urls_are_prepared_in_order(tmp_path):
    from transformers import AutoTokenizer

    vision_folder("qwen2_vl", str(tmp_path / "model"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    first, second = two_pictures()
    second.save(tmp_path / "b.png")
    buffer = io.BytesIO()
    first.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    conversation = [{"role": "user", "content": [
        {"type": "image", "image": first}, {"type": "text", "text": "and"},
        {"type": "image", "image": str(tmp_path / "b.png")}, {"type": "image_url", "image_url": {"url": url}}]}]
    assert with_pictures([conversation]) and not with_pictures([[{"role": "user", "content": "hi"}]])
    prompts, _, _, pictures = prepare_offline_chat(tokenizer, [conversation], [SamplingParams(max_tokens=4)],
                                                   vision=VisionProcessor.load(str(tmp_path / "model"), tokenizer))
    hashes = [p.content_hash for p in pictures[0]]
    assert hashes == [content_hash(first), content_hash(second), content_hash(first)]
    assert pictures[0][0].length == pictures[0][2].length != pictures[0][1].length  # sizes differ
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert prompts[0].count(pad) == sum(p.length for p in pictures[0])


@pytest.mark.slow
def test_llm_chat_refuses_a_picture_for_a_text_model(tiny_checkpoint):
    from deepinfer import LLM

    llm = LLM(tiny_checkpoint("llama"), num_blocks=32, block_size=8, max_model_len=128)
    try:
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\]: this model has no vision encoder"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "what is"},
                                                   {"type": "image", "image": two_pictures()[0]}]}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
        out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2  # text chats run as before
    finally:
        close = getattr(llm, "close", None)
        if close is not None:
            close()
