"""The live dashboard of `deepinfer serve`: a static page and the one JSON route it adds to /metrics.

    GET /dashboard         the page (static/dashboard.{html,js,css}); public, like the chat page
    GET /dashboard/state   the running requests and one request's block tables and rings, as JSON;
                           behind --api-key like /v1 (`?request_id=` picks the request, else the
                           oldest running one)

The page reads every figure it plots from /metrics (public, as ever) and the per-request picture
from /dashboard/state. That picture is built on the engine thread (`DashboardFeed.publish`, after
each iteration, beside the stats), never read from the scheduler by the HTTP thread; it is built
only while someone watches (a poll in the last `WATCH_S` seconds), so an unwatched server pays
nothing for it. It holds block ids and positions only, no token ids or text.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from fastapi import APIRouter, Depends
from fastapi.responses import FileResponse, Response

from deepinfer.engine.cache_view import cache_snapshot
from deepinfer.entrypoints.openai.errors import bad_request

logger = logging.getLogger("deepinfer.server")

WATCH_S = 5.0  # the engine thread builds the picture while the last poll is this recent
MAX_REQUEST_ID_CHARS = 256
STATIC_DIR = Path(__file__).with_name("static")
# the chat page's policy: its own script and style only, and calls to this server only
_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
             "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


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
        self.selected: str | None = None
        self.snapshot: dict | None = None
        self._watched_until = 0.0
        self._failed = False

    def publish(self, engine) -> None:
        """On the engine thread: the picture of now while watched; else drop the old one. A failure
        is logged once and never reaches the engine loop."""
        if time.monotonic() > self._watched_until:
            self.snapshot = None
            return
        try:
            snapshot = cache_snapshot(engine.scheduler.running, engine.kv_manager, self.windows, self.selected)
        except Exception:
            if not self._failed:
                logger.exception("the dashboard's cache picture failed; it stays empty")
            self._failed, self.snapshot = True, None
            return
        self.snapshot = {**snapshot, "time": time.time()}

    def view(self, request_id: str | None) -> dict:
        """The latest picture (`pending` until the engine's next iteration builds one) and the
        cache groups; asks the engine thread for `request_id`'s picture from now on."""
        self.selected = request_id
        self._watched_until = time.monotonic() + WATCH_S
        snapshot = self.snapshot
        if snapshot is None:
            return {"pending": True, "running": [], "request": None, "groups": self.groups}
        return {"pending": False, **snapshot, "groups": self.groups}


def dashboard_routes(state, key_dependency) -> APIRouter:
    """The page (public) and its JSON route (behind `key_dependency`); hooks a `DashboardFeed`
    into the server's engine loop."""
    feed = DashboardFeed(state.engine_loop.engine.runner.groups)
    state.engine_loop.dashboard = feed
    router = APIRouter()
    page = STATIC_DIR / "dashboard.html"

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return FileResponse(page, headers={"Content-Security-Policy": _PAGE_CSP, "Cache-Control": "no-cache"})

    @router.get("/dashboard/state", dependencies=[Depends(key_dependency)])
    async def dashboard_state(request_id: str | None = None) -> dict:
        if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
            raise bad_request(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got "
                              f"{len(request_id)}", param="request_id")
        return feed.view(request_id or None)

    return router
