"""The official openai, anthropic and ollama clients each send a picture to a tiny random LLaVA served
in-process, and get HF transformers' greedy answer to the same picture and text.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from picture_checkpoints import build_checkpoint, png_b64, two_pictures  # noqa: E402

MAX_TOKENS = 6
QUESTION = "what is in this picture"


def hf_answer(llava, picture, images_first: bool = False) -> str:
    """HF transformers' greedy answer to QUESTION about `picture` (the reference); `images_first`:
    the picture before the text (Ollama's order). The checkpoint's tokenizer is byte-level: the
    answers compare exactly."""
    from deepinfer.serving.pictures import to_rgb

    parts = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    return llava.hf_answer(parts[::-1] if images_first else parts, [to_rgb(picture)], MAX_TOKENS)[1]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """A tiny random LLaVA checkpoint folder (CLIP tower, Llama text model, tokenizer, chat template,
    image processor) and its HF reference."""
    return build_checkpoint("llava", str(tmp_path_factory.mktemp("tiny-llava")))


@pytest.fixture(scope="module")
def server(llava):
    from app_server import AppServer

    with AppServer("--model", llava.path, "--served-model-name", "tiny-llava", "--max-model-len", "256") as app:
        yield app


@pytest.mark.slow
def test_the_tiny_llava_checkpoint_builds(llava):
    import transformers as tf

    config = tf.AutoConfig.from_pretrained(llava.path)
    assert config.model_type == "llava" and os.path.exists(os.path.join(llava.path, "preprocessor_config.json"))
    assert hf_answer(llava, two_pictures()[0]) != hf_answer(llava, two_pictures()[1])  # pictures decide


@pytest.mark.slow
def test_openai_client_sends_a_picture(server, llava):
    picture = two_pictures()[1]
    answer = server.openai().chat.completions.create(
        model="tiny-llava", max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64(picture)}"}}]}])
    assert answer.choices[0].message.content == hf_answer(llava, picture)


@pytest.mark.slow
def test_anthropic_client_sends_a_picture(server, llava):
    import anthropic

    picture = two_pictures()[1]
    client = anthropic.Anthropic(base_url=server.listen(), api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(model="tiny-llava", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                     messages=[
        {"role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(picture)}}]}])
    assert message.content[0].text == hf_answer(llava, picture)


@pytest.mark.slow
def test_ollama_client_sends_a_picture(server, llava):
    import ollama

    picture = two_pictures()[1]
    client = ollama.Client(host=server.listen(), timeout=120)
    # Ollama's images come before the message's text: the reference asks the same way round
    reply = client.chat(model="tiny-llava", options={"temperature": 0, "num_predict": MAX_TOKENS},
                        messages=[{"role": "user", "content": QUESTION, "images": [png_b64(picture)]}])
    assert reply.message.content == hf_answer(llava, picture, images_first=True)

