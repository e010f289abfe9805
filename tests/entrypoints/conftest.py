"""Fixtures of the server tests: the apps several modules share, each loaded once for the session
(modules that use one are scheduled on one xdist worker: tests/conftest.py's SHARED_SESSION_FIXTURES).
A shared app is read-only to its tests: none closes it, changes its settings or reads counters that
another module's requests move."""

from __future__ import annotations

import pytest
from app_server import AppServer


@pytest.fixture(scope="session")
def default_server():
    """`deepinfer serve` without flags (the default model) as an in-process app, shared by every
    module that asks for it."""
    with AppServer() as app:
        yield app


@pytest.fixture(scope="session")
def tiny_app_server(tiny_checkpoint):
    """`deepinfer serve --model <tiny llama>` as an in-process app."""
    with AppServer("--model", tiny_checkpoint("llama")) as app:
        yield app


@pytest.fixture(scope="session")
def hermes_server(tiny_checkpoint, tmp_path_factory):
    """The tiny llama with the Hermes tool-call chat template, served as "tiny" (in-process app)."""
    from agent_models import HERMES, templated_checkpoint

    path = templated_checkpoint(tiny_checkpoint("llama"), str(tmp_path_factory.mktemp("hermes")), HERMES)
    with AppServer("--model", path, "--served-model-name", "tiny") as app:
        yield app


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (Debian's, or DEEPINFER_CHROMIUM) for the page tests, one per module."""
    from playwright.sync_api import sync_playwright
    from test_chat_page import CHROMIUM_FLAGS, chromium_path

    executable = chromium_path()
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=executable, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    """A fresh 1000 x 800 page (its own context) with a 60 s default timeout."""
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()
