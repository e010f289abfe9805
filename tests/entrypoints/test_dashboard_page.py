"""The dashboard at `/dashboard` of `deepinfer serve`, in a real headless Chromium (as the chat page
test): the figures it shows are the ones /metrics reports, its block table picture shows the blocks
/dashboard/state reports for the running request, and the state route needs the API key while the
page and /metrics stay public."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from live_server import LiveServer
from playwright.sync_api import Page, expect, sync_playwright
from test_chat_page import CHROMIUM_FLAGS, chromium_path

from deepinfer.engine.cache_view import ring_picture

pytestmark = [pytest.mark.live_server]

KEY = "dashboard-test-key"
PREFIX = ("The lighthouse keeper wrote in the log every evening: the wind, the sea, the ships that "
          "passed, the colour of the sky, and the names of the birds that rested on the rail. ")


@pytest.fixture(scope="module")
def server():
    with LiveServer(api_key=KEY) as live:
        yield live


@pytest.fixture
def page(server):
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        page = browser.new_context(viewport={"width": 1100, "height": 900}).new_page()
        page.set_default_timeout(30_000)
        yield page
        browser.close()


def complete(server, prompt: str, max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120)
    r.raise_for_status()
    return r.json()


def metrics(server) -> dict[str, float]:
    """The unlabelled samples of /metrics, and the labelled ones as `name{k="v"}`."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def open_dashboard(page: Page, server) -> None:
    page.goto(server.url + "/dashboard")
    page.evaluate("document.getElementById('settings').open = true")
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")


def next_refresh(page: Page) -> None:
    """Wait until the page has finished a refresh that started after this call."""
    seen = int(page.get_attribute("body", "data-refreshes"))
    page.wait_for_function("(n) => Number(document.body.dataset.refreshes) >= n", arg=seen + 2)


def shown(page: Page, element_id: str) -> str:
    return page.inner_text(f"#{element_id}")


@pytest.mark.slow
def test_the_page_shows_what_metrics_reports_and_the_running_requests_blocks(page, server, tmp_path):
    for i in range(3):  # counters move; the shared prefix gives prefix-cache hits
        complete(server, PREFIX + f"Entry {i}:", max_tokens=6)
    open_dashboard(page, server)
    next_refresh(page)
    want = metrics(server)  # the load has stopped: nothing changes until the next request
    next_refresh(page)
    raw = json.loads(page.get_attribute("body", "data-metrics"))
    assert shown(page, "v-running") == "0" == str(int(want["deepinfer_num_requests_running"]))
    assert shown(page, "v-waiting") == str(int(want["deepinfer_num_requests_waiting"]))
    assert shown(page, "v-gen-total") == str(int(want["deepinfer_generation_tokens_total"])) != "0"
    assert shown(page, "v-prompt-total") == str(int(want["deepinfer_prompt_tokens_total"])) != "0"
    assert shown(page, "v-gen-rate") == "0.0"  # idle between the two refreshes
    hits, queries = want["deepinfer_prefix_cache_hits_total"], want["deepinfer_prefix_cache_queries_total"]
    assert (raw["hits"], raw["queries"]) == (hits, queries) and hits > 0
    assert abs(float(shown(page, "v-hit-rate").rstrip("%")) - 100 * hits / queries) <= 0.05
    groups = {k.split('"')[1]: v for k, v in want.items() if k.startswith("deepinfer_kv_group_blocks_total")}
    assert groups, want
    for group, total in groups.items():
        used = want[f'deepinfer_kv_group_blocks_used{{group="{group}"}}']
        tile = page.locator(f'.tile[data-kind="paged"][data-group="{group}"] .value')
        assert tile.inner_text() == f"{int(used)} / {int(total)}"

    stop = threading.Event()
    thread = threading.Thread(target=_long_request, args=(server, stop), daemon=True)
    thread.start()
    try:
        expect(page.locator("#request-info")).not_to_have_attribute("data-request-id", "", timeout=30_000)
        next_refresh(page)
        picture = page.evaluate("""() => ({
            id: document.getElementById('request-info').dataset.requestId,
            blocks: [...document.querySelectorAll('#block-table .picture .block')].map(b => Number(b.dataset.blockId)),
            running: document.getElementById('v-running').textContent})""")
        state = httpx.get(f"{server.url}/dashboard/state", headers=server.headers, timeout=10).json()
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        print(f"dashboard screenshot: {tmp_path / 'dashboard.png'}")
    finally:
        stop.set()
        thread.join(60)
    request = state["request"]
    assert request["request_id"] == picture["id"] and [r["request_id"] for r in state["running"]] == [picture["id"]]
    (table,) = request["paged"]  # the default model: one paged group
    # the table only grows while the request runs: the page's blocks are the route's first ones
    assert picture["blocks"] and table["block_ids"][:len(picture["blocks"])] == picture["blocks"]
    assert len(table["block_ids"]) >= len(picture["blocks"]) >= -(-request["num_prompt_tokens"] // 16)
    assert picture["running"] == "1"
    expect(page.locator("#request-info")).to_have_attribute("data-request-id", "", timeout=30_000)
    expect(page.locator("#v-running")).to_have_text("0")


def _long_request(server, stop: threading.Event) -> None:
    """Stream a long answer until `stop` is set, then hang up (the server aborts the request)."""
    body = {"prompt": PREFIX, "max_tokens": 4000, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers,
                      timeout=120) as response:
        for _ in response.iter_lines():
            if stop.is_set():
                return


@pytest.mark.slow
def test_the_ring_picture_is_the_books_figure(page, server):
    """The default model has no ring group: the page draws the book's trace (W = 128, S = 134, state
    2, position 134 just written) from a state answer built by the engine's own picture builder."""
    ring = ring_picture("swa", state_id=2, ring_size=134, window=128, num_written=135)
    request = {"request_id": "book", "num_prompt_tokens": 135, "num_tokens": 135, "num_computed_tokens": 135,
               "num_cached_tokens": 0, "paged": [], "rings": [ring]}
    state = {"pending": False, "running": [{k: v for k, v in request.items() if k.startswith(("num", "req"))}],
             "request": request, "groups": []}
    page.route("**/dashboard/state*", lambda route: route.fulfill(json=state))
    open_dashboard(page, server)
    rows = page.locator('#rings .picture[data-group="swa"] .ring-row')
    expect(rows).to_have_count(134)
    cells = rows.evaluate_all("els => els.map(e => [e.className.split(' ')[1], e.textContent, e.title])")
    assert cells[0] == ["latest", "134", "row 0 · slot 268 · position 134"]  # wrote slot 268 over position 0
    assert [c[1] for c in cells[1:7]] == ["1", "2", "3", "4", "5", "6"] and {c[0] for c in cells[1:7]} == {"old"}
    assert {c[0] for c in cells[7:]} == {"window"} and cells[133][2] == "row 133 · slot 401 · position 133"
    expect(page.locator("#rings .group-name")).to_contain_text("window 7..134")


def test_the_page_is_public_and_its_state_route_needs_the_key(server):
    page = httpx.get(f"{server.url}/dashboard", timeout=10)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name in ("static/dashboard.js", "static/dashboard.css"):
        assert name in page.text and httpx.get(f"{server.url}/{name}", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200  # public, as before
    assert httpx.get(f"{server.url}/dashboard/state", timeout=10).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{server.url}/dashboard/state", headers=wrong, timeout=10).status_code == 401
    state = httpx.get(f"{server.url}/dashboard/state", headers=server.headers, timeout=10)
    assert state.status_code == 200 and {"running", "request", "groups", "pending"} <= set(state.json())
    long_id = httpx.get(f"{server.url}/dashboard/state", params={"request_id": "x" * 300},
                        headers=server.headers, timeout=10)
    assert long_id.status_code == 400 and "request_id" in long_id.text
