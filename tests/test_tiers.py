"""Test tiers are markers written in each test's file; helpers that do a tier's work check that the
running test carries its marker (`conftest.tier_marked`), so an unmarked one fails instead of
slipping into the fast tier."""

from __future__ import annotations

import pytest
from tiers import tier_marked


def test_an_unmarked_test_doing_a_tiers_work_fails():
    with pytest.raises(pytest.fail.Exception, match="is not marked @pytest.mark.live_server"):
        tier_marked("live_server", "starts `deepinfer serve` as a subprocess")


@pytest.mark.live_server
def test_a_marked_test_passes_the_check():
    tier_marked("live_server", "starts `deepinfer serve` as a subprocess")  # no failure
