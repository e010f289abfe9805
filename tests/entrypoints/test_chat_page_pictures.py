"""The chat page with pictures, in a real headless Chromium (as test_chat_page.py drives it): a picture
pasted into the prompt, and one dropped onto the page, show as thumbnails, go with the next message,
and the page shows HF transformers' greedy answer to that picture and text.

The server is a real `deepinfer serve` on a tiny random LLaVA checkpoint folder (picture_checkpoints.py:
its tokenizer, chat template and image processor); the page sends the message's text first, then its
pictures (`image_url` parts), and the reference asks the same way round.
"""

from __future__ import annotations

import os
import sys

import pytest
from live_server import LiveServer
from playwright.sync_api import expect
from test_chat_page import answers, open_with_key, send, wait_for_stats

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from picture_checkpoints import build_checkpoint, noise, png_b64  # noqa: E402

pytestmark = [pytest.mark.live_server]

KEY = "page-picture-key"
MAX_TOKENS = 8
QUESTION = "what is in this picture?"

# A File of `b64` (PNG bytes) handed to the page as the user's paste into the prompt, or drop onto it.
_PASTE = """(b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], "picture.png", {type: "image/png"}));
  document.getElementById("prompt").dispatchEvent(
    new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true}));
}"""
_DROP = """(b64) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], "picture.png", {type: "image/png"}));
  document.getElementById("messages").dispatchEvent(
    new DragEvent("drop", {dataTransfer: data, bubbles: true, cancelable: true}));
}"""


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_checkpoint("llava", str(tmp_path_factory.mktemp("page-llava")))


@pytest.fixture(scope="module")
def server(llava):
    with LiveServer("--model", llava.path, "--served-model-name", "tiny-llava", "--max-model-len", "256",
                    api_key=KEY) as live:
        yield live


def hf_answer(llava, picture) -> str:
    """HF's greedy answer to QUESTION then `picture` (the page's order: text, then pictures)."""
    return llava.hf_answer([{"type": "text", "text": QUESTION}, {"type": "image"}], [picture], MAX_TOKENS)[1]


def test_pasted_and_dropped_pictures_get_hf_answers(page, server, llava):
    pictures = [noise(80, 60, 11), noise(50, 110, 12)]
    want = [hf_answer(llava, p) for p in pictures]
    assert want[0] != want[1]  # the picture decides the answer: the page's must be the picture's own
    open_with_key(page, server, KEY)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))

    page.evaluate(_PASTE, png_b64(pictures[0]))
    expect(page.locator("#attachments img.thumb")).to_have_count(1)  # shown before it is sent
    send(page, QUESTION)
    wait_for_stats(page)
    assert answers(page) == [want[0]]
    expect(page.locator(".msg.user img.thumb")).to_have_count(1)
    expect(page.locator("#attachments")).to_be_hidden()  # it went with that message, not the next

    page.click("#new-chat")
    page.evaluate(_DROP, png_b64(pictures[1]))
    expect(page.locator("#attachments img.thumb")).to_have_count(1)
    send(page, QUESTION)
    wait_for_stats(page)
    assert answers(page) == [want[1]]
    src = page.locator(".msg.user img.thumb").get_attribute("src")
    assert src == "data:image/png;base64," + png_b64(pictures[1])
