"""The running test's tier markers, checked by helpers that do a tier's work (`tier_marked`): a test that
starts `deepinfer serve` without saying so fails instead of slipping into the fast tier."""

from __future__ import annotations

import pytest

RUNNING: list = [None]  # the running test's node (set by tests/conftest.py's autouse fixture)


def tier_marked(marker: str, what: str) -> None:
    """Fail the running test when it lacks `marker` (a test that does `what` must say so)."""
    node = RUNNING[0]
    if node is not None and node.get_closest_marker(marker) is None:
        pytest.fail(f"{node.nodeid} {what} but is not marked @pytest.mark.{marker}")
