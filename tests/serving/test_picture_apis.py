"""Pictures through every API's preparation (on the tokenizer pool, as the routes run it): OpenAI chat,
Responses, Anthropic Messages, Ollama chat and generate, /tokenize; each bad picture a 400 naming its
part in the API's own names, and the pictures handed to the engine with the prompt (a recording engine
loop stands in for the engine, whose `add_request(..., pictures=)` comes with the vision models)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

import pytest
from PIL import Image
from vision_checkpoints import two_pictures, vision_folder

from deepinfer.entrypoints.openai import messages, ollama, responses, server, tokenize_routes
from deepinfer.entrypoints.openai.errors import error_response
from deepinfer.serving import run
from deepinfer.serving.admission import PromptBounds
from deepinfer.serving.chat.prompt import ChatSetup
from deepinfer.serving.errors import ServingError
from deepinfer.serving.pictures import MediaPolicy
from deepinfer.serving.protocol import ChatCompletionRequest
from deepinfer.serving.tenancy import EVERYONE
from deepinfer.serving.vision import VisionProcessor


def png_b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


A, B = (png_b64(im) for im in two_pictures())
NOT_A_PICTURE = base64.b64encode(b"plain text, no picture").decode()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("llava"))
    vision_folder("llava", path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return tokenizer, VisionProcessor.load(path, tokenizer)


def fake_state(tokenizer, vision, **media) -> SimpleNamespace:
    """What the routes' preparation reads of a ServingContext."""
    return SimpleNamespace(
        chat_setup=ChatSetup(vision=vision, media=MediaPolicy(**media)), max_model_len=4096, sampling_defaults={},
        vocab_size=len(tokenizer), check_model=lambda model: None, bounds=PromptBounds(tokenizer, 4096),
        responses=SimpleNamespace(get=lambda *a: None), settings=SimpleNamespace(model_name="m"),
        adapters=SimpleNamespace(all=lambda: []))


def refusal(route: str, call) -> tuple[int, str]:
    """The status and message the route would answer for a refused request."""
    with pytest.raises(ServingError) as info:
        call()
    response = error_response(info.value, route)
    body = json.loads(response.body)
    message = body["error"] if isinstance(body["error"], str) else body["error"]["message"]
    return response.status_code, message


def openai_body(*parts, **extra) -> bytes:
    return json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": list(parts)}], **extra}).encode()


def image_url(b64: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}", "detail": "low"}}


def test_openai_chat_pictures_reach_the_engine_with_their_runs(llava):
    tokenizer, vision = llava
    state = fake_state(tokenizer, vision)
    raw = openai_body({"type": "text", "text": "what is"}, image_url(A), image_url(B), max_tokens=5)
    _, prepared = server._prepare(tokenizer, state, raw, ChatCompletionRequest)
    assert len(prepared.pictures) == 2 and prepared.pictures[0].content_hash != prepared.pictures[1].content_hash
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    assert all(prepared.prompt_ids[p.offset:p.end] == [image_token] * p.length for p in prepared.pictures)

    added = {}

    async def add(request_id, prompt_ids, params, arrival, salt, lora, **scheduling):
        added.update(scheduling, prompt_ids=prompt_ids)
        return "handle"

    ctx = SimpleNamespace(lora_request=lambda model: None, engine_loop=SimpleNamespace(add=add),
                          settings=SimpleNamespace(priority_range=SimpleNamespace(check=lambda *a: None),
                                                   shared_prefix_cache=False))
    asyncio.run(run.admit(ctx, "r1", prepared, EVERYONE))
    assert added["pictures"] == prepared.pictures and added["prompt_ids"] == prepared.prompt_ids


def test_openai_chat_bad_pictures_name_their_part(llava):
    tokenizer, vision = llava
    state = fake_state(tokenizer, vision, max_pictures_per_request=2)

    def prepare(*parts):
        return lambda: server._prepare(tokenizer, state, openai_body(*parts), ChatCompletionRequest)

    status, message = refusal("/v1/chat/completions", prepare({"type": "text", "text": "a"}, image_url(NOT_A_PICTURE)))
    assert status == 400 and message.startswith("messages[1].content[1]: ") and "not a picture" in message
    status, message = refusal("/v1/chat/completions", prepare(image_url(A), image_url(A[:-7])))
    assert message.startswith("messages[1].content[1]: ") and "base64" in message
    status, message = refusal("/v1/chat/completions", prepare(image_url(A), image_url(A), image_url(A)))
    assert message.startswith("messages[1].content[2]: ") and "at most 2" in message
    url = {"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png"}}
    status, message = refusal("/v1/chat/completions", prepare(url))
    assert message.startswith("messages[1].content[0]: ") and "--allow-remote-media" in message
    file_url = {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}
    assert "--allowed-media-dir" in refusal("/v1/chat/completions", prepare(file_url))[1]
    status, message = refusal("/v1/chat/completions", prepare({"type": "input_audio", "input_audio": {}}))
    assert status == 400 and "input_audio" in message


def test_a_picture_to_a_text_model_is_refused_naming_it(llava):
    tokenizer, _ = llava
    state = fake_state(tokenizer, None)
    status, message = refusal("/v1/chat/completions", lambda: server._prepare(
        tokenizer, state, openai_body({"type": "text", "text": "a"}, image_url(A)), ChatCompletionRequest))
    assert status == 400 and message.startswith("messages[1].content[1]: ") and "no vision encoder" in message
    raw = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": A}}]}]}).encode()
    status, message = refusal("/v1/messages", lambda: messages._prepare(tokenizer, state, raw))
    assert status == 400 and "messages[0].content[0]" in message and "no vision encoder" in message


def test_anthropic_image_blocks(llava):
    tokenizer, vision = llava
    state = fake_state(tokenizer, vision)

    def body(*blocks, count=False):
        return json.dumps({"model": "m", **({} if count else {"max_tokens": 5}), "system": "be brief", "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": list(blocks)}]}).encode()

    def image(data, media_type="image/png"):
        return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}

    _, prepared = messages._prepare(tokenizer, state, body(image(A), {"type": "text", "text": "what is"}, image(B)))
    assert len(prepared.pictures) == 2
    text = {"type": "text", "text": "what"}
    assert messages._count_tokens(tokenizer, state, body(image(A), text, count=True)) == len(
        messages._prepare(tokenizer, state, body(image(A), text))[1].prompt_ids)
    status, message = refusal("/v1/messages", lambda: messages._prepare(
        tokenizer, state, body({"type": "text", "text": "a"}, image(NOT_A_PICTURE))))
    assert status == 400 and message.startswith("messages[2].content[1]: ") and "not a picture" in message
    status, message = refusal("/v1/messages", lambda: messages._prepare(tokenizer, state, body(
        {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}})))
    assert message.startswith("messages[2].content[0]: ") and "--allow-remote-media" in message
    status, message = refusal("/v1/messages", lambda: messages._prepare(tokenizer, state, body(image(A, "text/plain"))))
    assert message.startswith("messages[2].content[0].source.media_type: ")


def test_ollama_images_on_chat_and_generate(llava):
    tokenizer, vision = llava
    state = fake_state(tokenizer, vision)
    chat = {"model": "m", "stream": False, "messages": [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "what is", "images": [A, B]}]}
    _, _, prepared = ollama._prepare_chat(tokenizer, state, json.dumps(chat).encode())
    assert len(prepared.pictures) == 2
    chat["messages"][1]["images"] = [A, NOT_A_PICTURE]
    status, message = refusal("/api/chat", lambda: ollama._prepare_chat(tokenizer, state, json.dumps(chat).encode()))
    assert status == 400 and message.startswith("messages[1].images[1]: ") and "not a picture" in message
    generate = {"model": "m", "stream": False, "prompt": "what is", "images": [B]}
    _, _, prepared = ollama._prepare_generate(tokenizer, state, json.dumps(generate).encode())
    assert len(prepared.pictures) == 1
    generate["images"] = ["%%%"]
    status, message = refusal("/api/chat", lambda: ollama._prepare_generate(tokenizer, state,
                                                                         json.dumps(generate).encode()))
    assert message.startswith("images[0]: ") and "base64" in message


def test_responses_input_image(llava):
    tokenizer, vision = llava
    state = fake_state(tokenizer, vision)
    body = {"model": "m", "instructions": "be brief", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what is"},
                                     {"type": "input_image", "image_url": f"data:image/png;base64,{A}"}]}]}
    _, _, prepared = responses._prepare(tokenizer, state, json.dumps(body).encode(), EVERYONE)
    assert len(prepared.pictures) == 1
    body["input"][0]["content"][1]["image_url"] = f"data:image/png;base64,{NOT_A_PICTURE}"
    status, message = refusal("/v1/responses", lambda: responses._prepare(tokenizer, state, json.dumps(body).encode(),
                                                                      EVERYONE))
    assert status == 400 and message.startswith("input[0].content[1]: ") and "not a picture" in message
    body["input"][0]["content"][1] = {"type": "input_image", "file_id": "file-1"}
    status, message = refusal("/v1/responses", lambda: responses._prepare(tokenizer, state, json.dumps(body).encode(),
                                                                      EVERYONE))
    assert message.startswith("input[0].content[1].image_url: ") and "file_id" in message


def test_tokenize_counts_the_expanded_placeholders(llava):
    tokenizer, vision = llava
    state = fake_state(tokenizer, vision)
    with_picture = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is"}, image_url(A)]}]}
    pictured = tokenize_routes._tokenize(tokenizer, state, json.dumps(with_picture).encode())
    length = 16  # LLaVA, 56 x 56 pixels in 14-pixel patches, the CLS row dropped
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "what is"},
                                                                       {"type": "image"}]}],
                                         tokenize=False, add_generation_prompt=True)
    expected = tokenizer(text.replace("<image>", "<image>" * length), add_special_tokens=False)["input_ids"]
    assert pictured["count"] == len(expected) and pictured["tokens"] == list(expected)
    assert pictured["tokens"].count(tokenizer.convert_tokens_to_ids("<image>")) == length
