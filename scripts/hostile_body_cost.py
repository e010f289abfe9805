"""What a 7.5 MB wrong-typed body costs a running `deepinfer serve`: per route, the status of the answer,
the seconds until it came, and the slowest /health answer while it was being refused.

    deepinfer serve --port 8000 --pooling mean &
    python scripts/hostile_body_cost.py http://127.0.0.1:8000 [--api-key KEY]

Each body is {FIELD: [null x 1,500,000]} (about 7.5 MB), the shape a review found to freeze a server
for 30-52 s when pydantic built millions of error objects. Figures are wall-clock seconds on the
machine that runs both, for the record (docs, closing notes), never for a test's assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

ITEMS = 1_500_000
ROUTES = (("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/v1/embeddings", "input"),
          ("/v1/messages/count_tokens", "messages"), ("/api/embed", "input"), ("/tokenize", "messages"),
          ("/v1/responses", "input"), ("/api/chat", "messages"))


def body(field: str) -> bytes:
    return b'{"model": "m", "' + field.encode() + b'": [' + b"null," * (ITEMS - 1) + b"null]}"


async def health_while(client: httpx.AsyncClient, done: asyncio.Event) -> float:
    """The slowest /health answer while `done` is unset."""
    slowest = 0.0
    while not done.is_set():
        start = time.monotonic()
        await client.get("/health")
        slowest = max(slowest, time.monotonic() - start)
        await asyncio.sleep(0.05)
    return slowest


async def one(client: httpx.AsyncClient, path: str, field: str) -> tuple[int, float, float]:
    raw, done = body(field), asyncio.Event()
    watcher = asyncio.create_task(health_while(client, done))
    start = time.monotonic()
    resp = await client.post(path, content=raw, headers={"Content-Type": "application/json"})
    seconds = time.monotonic() - start
    done.set()
    return resp.status_code, seconds, await watcher


async def main(url: str, api_key: str | None) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as client:
        print(f"{'route':28} {'status':>6} {'answered in':>12} {'slowest /health':>16}")
        for path, field in ROUTES:
            status, seconds, health = await one(client, path, field)
            print(f"{path:28} {status:>6} {seconds:>10.2f} s {health:>14.3f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.api_key))
