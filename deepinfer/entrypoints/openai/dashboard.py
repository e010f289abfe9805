"""The live dashboard of `deepinfer serve`: a static page and the one JSON route it adds to /metrics.

    GET /dashboard         the page (static/dashboard.{html,js,css}); public, like the chat page
    GET /dashboard/state   the running requests and one request's block tables and rings, as JSON;
                           behind --api-key like /v1 (`?request_id=` picks the request, else the
                           oldest running one)

The page reads every figure it plots from /metrics (public, as ever) and the per-request picture
from /dashboard/state, built on the engine thread (`serving.dashboard_feed`). With API keys a key
sees only its own requests there; an operator key (--admin-api-key) sees all.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response

from deepinfer.entrypoints.openai.auth import tenant_of
from deepinfer.serving.dashboard_feed import DashboardFeed
from deepinfer.serving.errors import bad_request

MAX_REQUEST_ID_CHARS = 256
STATIC_DIR = Path(__file__).with_name("static")
# the chat page's policy: its own script and style only, and calls to this server only
_PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
             "img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def page_headers() -> dict[str, str]:
    """The headers of the chat page and the dashboard page: their policy, and no stale copy."""
    return {"Content-Security-Policy": _PAGE_CSP, "Cache-Control": "no-cache"}


def dashboard_routes(state, key_dependency) -> APIRouter:
    """The page (public) and its JSON route (behind `key_dependency`); hooks a `DashboardFeed`
    into the server's engine loop."""
    feed = DashboardFeed(state.engine.runner.groups)
    state.engine_loop.dashboard = feed
    router = APIRouter()
    page = STATIC_DIR / "dashboard.html"

    @router.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> Response:
        return FileResponse(page, headers=page_headers())

    @router.get("/dashboard/state", dependencies=[Depends(key_dependency)])
    async def dashboard_state(request: Request, request_id: str | None = None) -> dict:
        if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
            raise bad_request(f"must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}",
                              "request_id")
        return feed.view(tenant_of(request), request_id or None)

    return router
