"""Fixtures of the server tests: the default model's app, loaded once for the session."""

from __future__ import annotations

import pytest
from app_server import AppServer


@pytest.fixture(scope="session")
def default_server():
    """`deepinfer serve` without flags (the default model) as an in-process app, shared by every
    module that asks for it."""
    with AppServer() as app:
        yield app
