"""Bad pictures over HTTP, on `deepinfer serve` in-process: each a 400 in its API's shape naming the
part, sent in one batch with good requests, none of which is lost.

The model is the tiny text llama: first as it is (a picture is "no vision encoder"), then with a
vision processor put in its place, so that the pictures themselves are checked (each refusal here
comes before the chat template runs, which is all that a text model's template would not do).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import struct
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
from app_server import AppServer
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "serving"))
from vision_checkpoints import vision_folder  # noqa: E402


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def png(size=(8, 8)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (1, 2, 3)).save(buffer, format="PNG")
    return buffer.getvalue()


def bomb() -> bytes:
    """A 60-byte PNG whose header claims 100000 x 100000 pixels."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pictures")
    (root / "media").mkdir()
    (root / "private.png").write_bytes(png())
    os.symlink(root / "private.png", root / "media" / "link.png")
    return root


@pytest.fixture(scope="module")
def server(tiny_checkpoint, media_dir):
    with AppServer("--model", tiny_checkpoint("llama"), "--served-model-name", "tiny",
                   "--max-pictures-per-request", "2", "--allowed-media-dir", str(media_dir / "media")) as app:
        yield app


def chat(url: str, *more: str) -> dict:
    parts = [{"type": "text", "text": "what is"}] + [{"type": "image_url", "image_url": {"url": u}}
                                                     for u in (url, *more)]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


def text_chat() -> dict:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def error_message(response) -> str:
    body = response.json()
    error = body["error"]
    return error if isinstance(error, str) else error["message"]


@pytest.mark.slow
def test_a_picture_to_the_text_model_is_a_400_naming_it(server):
    r = server.client.post("/v1/chat/completions", json=chat(f"data:image/png;base64,{b64(png())}"))
    assert r.status_code == 400 and error_message(r).startswith("messages[0].content[1]: ")
    assert "no vision encoder" in error_message(r)
    r = server.client.post("/api/chat", json={"model": "tiny", "stream": False,
                                              "messages": [{"role": "user", "content": "hi", "images": [b64(png())]}]})
    assert r.status_code == 400 and error_message(r).startswith("messages[0].images[0]: ")
    r = server.client.post("/tokenize", json={"messages": chat(f"data:image/png;base64,{b64(png())}")["messages"]})
    assert r.status_code == 400 and "no vision encoder" in error_message(r)


@pytest.mark.slow
def test_bad_pictures_in_a_batch_are_400s_and_the_good_requests_are_answered(server, media_dir, tmp_path):
    vision_folder("llava", str(tmp_path))
    from deepinfer.serving.vision import VisionProcessor

    state = server.app.state.server
    original = state.chat_setup
    state.chat_setup = dataclasses.replace(original, vision=VisionProcessor.load(str(tmp_path)))
    ok = f"data:image/png;base64,{b64(png())}"
    bad = {  # body -> (field path, words of the reason)
        "not a picture": (chat(f"data:image/png;base64,{b64(b'text')}"), "messages[0].content[1]", "not a picture"),
        "truncated": (chat(f"data:image/png;base64,{b64(png())[:-5]}"), "messages[0].content[1]", "base64"),
        "bomb": (chat(f"data:image/png;base64,{b64(bomb())}"), "messages[0].content[1]", "--max-picture-pixels"),
        "too many": (chat(ok, ok, ok), "messages[0].content[3]", "--max-pictures-per-request"),
        "outside": (chat(f"file://{media_dir}/private.png"), "messages[0].content[1]", "outside"),
        "symlink": (chat(f"file://{media_dir}/media/link.png"), "messages[0].content[1]", "outside"),
        "dot-dot": (chat(f"file://{media_dir}/media/../private.png"), "messages[0].content[1]", "outside"),
        "http": (chat("http://127.0.0.1:1/x.png"), "messages[0].content[1]", "--allow-remote-media"),
    }
    try:
        with ThreadPoolExecutor(6) as pool:
            good = [pool.submit(server.client.post, "/v1/chat/completions", json=text_chat()) for _ in range(4)]
            refused = {name: pool.submit(server.client.post, "/v1/chat/completions", json=body)
                       for name, (body, _, _) in bad.items()}
            anthropic = pool.submit(server.client.post, "/v1/messages", json={
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": b64(bomb())}}]}]})
        for name, future in refused.items():
            r, (_, path, words) = future.result(), bad[name]
            assert r.status_code == 400, (name, r.text)
            assert error_message(r).startswith(path + ": ") and words in error_message(r), (name, r.text)
        r = anthropic.result()
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert error_message(r).startswith("messages[0].content[0]: ") and "--max-picture-pixels" in error_message(r)
        for future in good:
            r = future.result()
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    finally:
        state.chat_setup = original
