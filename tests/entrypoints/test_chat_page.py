"""The chat page at `/` of `deepinfer serve`, driven in a real headless Chromium (Debian's package,
through playwright): the key field, a streamed answer with its tokens/s, history and cached prompt
tokens on a second turn, Stop and New chat, a 401 for a wrong key, and a narrow screen.

The server is a real `deepinfer serve` on the default model with `--api-key`; the answers the page
shows are checked against the same server's non-streamed answers for the same conversation.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import httpx
import pytest
from live_server import LiveServer
from playwright.sync_api import Page, expect

pytestmark = [pytest.mark.live_server]

KEY = "page-test-key"
MAX_TOKENS = 24
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_HINT = ("the chat page test needs Debian's chromium, and there is no Chromium at {path}: run `apt-get "
                "update && apt-get install -y chromium` as root (`make test` does this when it runs as root), "
                "or set DEEPINFER_CHROMIUM to a Chromium binary")

# Records (ms, length of the last answer's text) on every change of the messages, in the page itself,
# so that no growth between two polls from here is missed.
_RECORD_ANSWER_GROWTH = """() => {
  window.__answerLengths = [];
  const box = document.getElementById("messages");
  new MutationObserver(() => {
    const answers = box.querySelectorAll(".msg.assistant");
    const last = answers[answers.length - 1];
    window.__answerLengths.push([performance.now(), last ? last.textContent.length : 0]);
  }).observe(box, {childList: true, subtree: true, characterData: true});
}"""


def chromium_path() -> str:
    path = os.environ.get("DEEPINFER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        pytest.fail(INSTALL_HINT.format(path=path), pytrace=False)
    return path


@pytest.fixture(scope="module")
def server():
    with LiveServer(api_key=KEY) as live:
        yield live


def served_model(server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=server.headers, timeout=10).json()["data"][0]["id"]


def open_with_key(page: Page, server, key: str) -> None:
    page.goto(server.url + "/")
    page.evaluate("document.getElementById('settings').open = true")  # as a click on Settings would
    page.fill("#api-key", key)
    page.dispatch_event("#api-key", "change")


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def wait_for_stats(page: Page) -> dict[str, float]:
    """The figures of the stats line once the answer has finished."""
    expect(page.locator("#stats")).to_contain_text("tokens/s", timeout=90_000)
    text = page.inner_text("#stats")
    m = re.search(r"([\d.]+) tokens/s · (\d+) tokens .* prompt (\d+) tokens, (\d+) cached", text)
    assert m, text
    return {"rate": float(m[1]), "tokens": int(m[2]), "prompt": int(m[3]), "cached": int(m[4])}


def reference_answer(server, messages: list[dict]) -> dict:
    """The same server's non-streamed answer (greedy) to `messages`."""
    body = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    r.raise_for_status()
    return r.json()


def answers(page: Page) -> list[str]:
    return page.locator(".msg.assistant").all_text_contents()


@pytest.mark.slow
def test_page_streams_answers_with_history_and_stats(page, server, tmp_path):
    open_with_key(page, server, KEY)
    expect(page.locator("#model")).to_have_text(served_model(server))
    assert page.evaluate("localStorage.getItem('deepinfer.apiKey')") == KEY
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.evaluate(_RECORD_ANSWER_GROWTH)

    question = "Name three colours of the rainbow."
    send(page, question)
    first = wait_for_stats(page)
    lengths = [n for _, n in page.evaluate("window.__answerLengths") if n > 0]
    shown = answers(page)[0]
    # streamed: the answer was on screen at several growing lengths before it was whole
    assert len(set(lengths)) >= 3, lengths
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1] == len(shown), lengths
    whole = reference_answer(server, [{"role": "user", "content": question}])
    assert shown == whole["choices"][0]["message"]["content"]
    assert first["tokens"] == whole["usage"]["completion_tokens"] and first["rate"] > 0
    assert first["prompt"] == whole["usage"]["prompt_tokens"]

    follow_up = "Which of them is warmest?"
    send(page, follow_up)
    expect(page.locator(".msg.assistant")).to_have_count(2)
    second = wait_for_stats(page)
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": shown},
               {"role": "user", "content": follow_up}]
    whole = reference_answer(server, history)
    assert answers(page)[1] == whole["choices"][0]["message"]["content"]
    assert second["prompt"] == whole["usage"]["prompt_tokens"] > first["prompt"] + first["tokens"]
    # the first turn's prompt is a prefix of the second's: the server found (some of) it cached
    assert 0 < second["cached"] <= second["prompt"]

    shot = tmp_path / "chat_page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 0
    print(f"chat page screenshot: {shot}")


@pytest.mark.slow
def test_stop_keeps_the_partial_answer_and_new_chat_clears(page, server):
    open_with_key(page, server, KEY)
    expect(page.locator("#model")).to_have_text(served_model(server))
    send(page, "Write a long story about a lighthouse keeper.")  # no max tokens: runs until stopped
    answer = page.locator(".msg.assistant")
    expect(answer).not_to_have_text("")
    page.click("#stop")
    expect(page.locator("#stats")).to_have_text("Stopped.")
    stopped = answer.text_content()
    time.sleep(0.5)
    assert answer.text_content() == stopped and stopped
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()

    page.click("#new-chat")
    expect(page.locator("#messages .msg")).to_have_count(0)
    expect(page.locator("#stats")).to_have_text("")


@pytest.mark.slow
def test_wrong_key_shows_401_and_user_text_stays_text(page, server):
    open_with_key(page, server, "not-the-key")
    error = page.locator("#error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("401")
    expect(error).to_contain_text("API key")

    text = "<b>bold?</b><img src=x onerror=\"document.title='injected'\">"
    page.fill("#prompt", text)
    page.click("#send")
    expect(page.locator(".msg.user.failed")).to_have_count(1)
    expect(error).to_contain_text("401")
    user = page.locator(".msg.user")
    assert user.text_content() == text
    assert user.evaluate("el => el.children.length") == 0
    assert page.title() != "injected"
    expect(page.locator(".msg.assistant")).to_have_count(0)
    expect(page.locator("#prompt")).to_have_value(text)  # given back, to resend with the right key


@pytest.mark.slow
def test_page_fits_a_narrow_screen(browser, server, tmp_path):
    context = browser.new_context(viewport={"width": 360, "height": 700}, is_mobile=True)
    try:
        page = context.new_page()
        open_with_key(page, server, KEY)
        expect(page.locator("#model")).to_have_text(served_model(server))
        assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        for selector in ("#prompt", "#send", "#stop", "#new-chat", "#api-key", "#max-tokens"):
            box = page.locator(selector).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 360, (selector, box)
        shot = tmp_path / "chat_page_narrow.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"narrow chat page screenshot: {shot}")
    finally:
        context.close()


def test_page_is_public_and_its_api_calls_need_the_key(server):
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name in re.findall(r'(?:src|href)="(static/[^"]+)"', page.text):
        assert httpx.get(f"{server.url}/{name}", timeout=10).status_code == 200, name
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
