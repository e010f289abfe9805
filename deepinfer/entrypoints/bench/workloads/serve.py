"""`deepinfer bench serve`: replay the cpu32 workload against a running OpenAI-compatible server.

Each request sends its prompt as token ids to /v1/completions with the workload's max_tokens,
temperature 0 and `ignore_eos`, streamed with a final usage chunk. Requests start either under
a fixed concurrency or as a Poisson process of `--request-rate` per second. Reported: request
and output-token throughput, TTFT, TPOT (mean time per output token after the first, per
request), ITL (gaps between streamed chunks) as mean and p50/p90/p99, and errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from deepinfer.entrypoints.bench.report import PERCENTILES, print_serve_summary
from deepinfer.entrypoints.bench.workloads import make_workload


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def add_bench_serve_parser(bench_parser) -> None:
    """Register `deepinfer bench serve` under the `bench` parser."""
    sub = bench_parser.add_subparsers(dest="bench_mode", title="modes", metavar="{serve}",
                                      help="without a mode: the offline benchmark")
    p = sub.add_parser("serve", help="benchmark a running `deepinfer serve` (or any OpenAI-compatible "
                       "server) with the cpu32 workload")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--num-requests", type=int, default=64, help="requests (cpu32 lengths)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="requests in flight (default 16)")
    mode.add_argument("--request-rate", type=float, default=None,
                      help="Poisson arrivals per second instead of a fixed concurrency")
    p.add_argument("--served-model", default=None, help="model id to send (default: the server's)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="for the random prompts (default: from the server's /v1/models)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of prompts and arrivals")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.set_defaults(func=run_bench_serve)


def run_bench_serve(args) -> int:
    for name, value in (("num_requests", args.num_requests), ("concurrency", args.concurrency)):
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.request_rate is not None and args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    summary = asyncio.run(_bench(args))
    print_serve_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed_requests"] == 0 else 1


async def _bench(args) -> dict:
    import httpx

    base = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.concurrency or (args.num_requests if args.request_rate else 16)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None, limits=limits) as client:
        card = await _model_card(client)
        model = args.served_model or card["id"]
        vocab = args.vocab_size or card.get("vocab_size")
        if not vocab:
            raise ValueError("the server does not report vocab_size; pass --vocab-size")
        workload = make_workload("cpu32", vocab, args.num_requests, args.workload_seed)
        await _send(client, model, [1, 2, 3], 2)  # warm-up
        start = time.perf_counter()
        results = await _run_all(client, model, workload, limit, args.request_rate, args.workload_seed)
        duration = time.perf_counter() - start
    summary = summarize(results, duration, workload.num_output_tokens)
    summary.update(url=base, model=model, num_requests=args.num_requests,
                   concurrency=None if args.request_rate and not args.concurrency else limit,
                   request_rate=args.request_rate)
    return summary


async def _model_card(client) -> dict:
    import httpx

    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {client.base_url}: {exc}") from exc
    if resp.status_code != 200:
        raise ValueError(f"GET /v1/models answered {resp.status_code}: {resp.text[:200]}")
    return resp.json()["data"][0]


async def _run_all(client, model, workload, limit: int, rate: float | None, seed: int) -> list:
    gate = asyncio.Semaphore(limit)
    rng = random.Random(seed)

    async def one(prompt, max_tokens):
        async with gate:
            return await _send(client, model, prompt, max_tokens)

    tasks = []
    for prompt, max_tokens in zip(workload.prompts, workload.output_lens, strict=True):
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
        if rate is not None:
            await asyncio.sleep(rng.expovariate(rate))
    return await asyncio.gather(*tasks)


async def _send(client, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """One streamed completion, timed on the client."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                last = _on_chunk(result, json.loads(line[6:]), start, last)
    except Exception as exc:  # a failed request is counted, never fatal
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = not result.error and result.output_tokens > 0
    return result


def _on_chunk(result: RequestResult, chunk: dict, start: float, last: float) -> float:
    if "error" in chunk:
        result.error = str(chunk["error"].get("message", chunk["error"]))
    if chunk.get("usage"):
        result.output_tokens = chunk["usage"]["completion_tokens"]
    if not chunk.get("choices"):
        return last
    now = time.perf_counter()
    if result.ttft == 0.0:
        result.ttft = now - start
    else:
        result.itls.append(now - last)
    return now


def summarize(results: list[RequestResult], duration: float, expected_tokens: int) -> dict:
    """Throughput and latency statistics (milliseconds) over the successful requests."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    summary = {"duration_s": duration, "successful_requests": len(ok),
               "failed_requests": len(results) - len(ok), "total_input_tokens": input_tokens,
               "total_output_tokens": output_tokens, "expected_output_tokens": expected_tokens,
               "request_throughput": len(ok) / duration,
               "output_throughput": output_tokens / duration,
               "total_token_throughput": (input_tokens + output_tokens) / duration,
               "errors": sorted({r.error for r in results if r.error})[:10]}
    for name, values in (("ttft", [r.ttft for r in ok]),
                         ("tpot", [r.tpot for r in ok if r.tpot is not None]),
                         ("itl", [x for r in ok for x in r.itls]),
                         ("e2el", [r.latency for r in ok])):
        summary.update(_stats_ms(name, values))
    return summary


def _stats_ms(name: str, values: list[float]) -> dict:
    import numpy as np

    if not values:
        return {f"mean_{name}_ms": None} | {f"p{p}_{name}_ms": None for p in PERCENTILES}
    ms = np.asarray(values) * 1000.0
    stats = {f"mean_{name}_ms": float(ms.mean())}
    stats.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return stats
