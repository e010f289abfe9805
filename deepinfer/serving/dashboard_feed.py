"""The dashboard's picture of the cache, published by the engine thread and read per tenant.

The engine thread builds it after each iteration (`DashboardFeed.publish`, beside the stats), never
read from the scheduler by the HTTP thread, and only while someone watches (a poll in the last
`WATCH_S` seconds), so an unwatched server pays nothing for it. It holds block ids and positions
only, no token ids or text. A tenant sees only its own requests (the client each counts for is its
tenant, with API keys): another tenant's ids, prompt lengths and progress are left out, and so is
the picture of a request that is not its own. An operator key sees all.
"""

from __future__ import annotations

import logging
import time

from deepinfer.engine.cache_view import cache_snapshot
from deepinfer.serving.tenancy import EVERYONE, Tenant

logger = logging.getLogger("deepinfer.server")

WATCH_S = 5.0  # the engine thread builds the picture while the last poll is this recent


class DashboardFeed:
    """The cache picture the engine thread publishes for the dashboard.

    Engine thread: `publish(engine)` after each iteration. HTTP thread: `view(request_id)` reads
    the latest picture and asks for `request_id` in the next one. Each side only rebinds
    attributes the other reads (atomic in Python); the picture is plain data, never mutated
    once published."""

    def __init__(self, groups):
        self.windows = {g.name: g.window for g in groups if g.is_ring}
        self.groups = [{"group": g.name, "kind": g.kind, "rows_per_unit": g.rows_per_unit, "window": g.window,
                        "compress_ratio": g.compress_ratio} for g in groups]
        self.selected: tuple[Tenant, str | None] = (EVERYONE, None)  # who asks, for which request
        self.snapshot: dict | None = None
        self._watched_until = 0.0
        self._failed = False

    def publish(self, engine) -> None:
        """On the engine thread: the picture of now while watched; else drop the old one. A failure
        is logged once and never reaches the engine loop."""
        if time.monotonic() > self._watched_until:
            self.snapshot = None
            return
        tenant, request_id = self.selected
        try:
            snapshot = cache_snapshot(engine.scheduler.running, engine.kv_manager, self.windows, request_id,
                                      tenant.owns)
        except Exception:
            if not self._failed:
                logger.exception("the dashboard's cache picture failed; it stays empty")
            self._failed, self.snapshot = True, None
            return
        self.snapshot = {**snapshot, "time": time.time(), "for": tenant}

    def view(self, tenant: Tenant, request_id: str | None) -> dict:
        """The latest picture as `tenant` may see it (its own requests; all for an operator key),
        `pending` until the engine's next iteration builds one, and the cache groups; asks the engine
        thread for `request_id`'s picture (among the tenant's) from now on."""
        self.selected = (tenant, request_id)
        self._watched_until = time.monotonic() + WATCH_S
        snapshot = self.snapshot
        if snapshot is None:
            return {"pending": True, "running": [], "request": None, "groups": self.groups}
        running = [_public(r) for r in snapshot["running"] if tenant.owns(r["owner"])]
        picture = snapshot["request"] if snapshot["for"] == tenant else None  # built for another viewer
        if picture is not None and not (tenant.owns(picture["owner"]) and request_id in (None, picture["request_id"])):
            picture = None
        return {"pending": False, "running": running, "request": _public(picture) if picture else None,
                "time": snapshot["time"], "groups": self.groups}


def _public(summary: dict) -> dict:
    """A request's summary without its owner (a hash of a key: nobody's business on the page)."""
    return {key: value for key, value in summary.items() if key != "owner"}
