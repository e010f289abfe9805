"""entrypoints: one request through the offline engine and through the server, idle and busy.

`deepinfer generate`, `deepinfer chat` and `LLM.generate` run the engine in the calling process's
main thread; `deepinfer serve` runs it in an engine thread of the server process. The two must decode
at the same speed, also when other processes take the cores. This workload measures both on the same
request (a fixed 32-token prompt of random ids, 129 output tokens, greedy, EOS ignored; one untimed
warm-up, then --repetitions runs):

    offline  an LLM in this process, the request alone (`llama_bench.time_request`)
    server   `deepinfer serve` started as a child process with the same model, threads and context,
             the request streamed from /v1/completions (`serve._send`) once the server is ready

Reported per engine: decode tokens/s (128 / first token to last, as tg128) and request tokens/s (129 /
submission to last), mean over the runs, and the ratio offline / server. With --busy N the whole
measurement is repeated with N busy-loop processes (`while True: pass`) running beside both engines,
as on a machine shared with other work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from deepinfer.entrypoints.bench.common import BenchResult
from deepinfer.entrypoints.engine_args import make_llm
from deepinfer.sampling_params import SamplingParams

PROMPT_LEN, OUTPUT_LEN = 32, 129
READY_TIMEOUT_S = 600.0


def add_entrypoints_args(p) -> None:
    p.add_argument("--busy", type=int, default=0,
                   help="entrypoints: also measure with this many busy-loop processes beside the engines")


def prompt_ids(vocab_size: int, seed: int = 0) -> list[int]:
    rng = random.Random(f"entrypoints-{seed}")
    return [rng.randrange(100, vocab_size) for _ in range(PROMPT_LEN)]


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[subprocess.Popen]]:
    """`n` processes spinning on a core each until the block ends (killed and reaped then)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.2 if n else 0)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def result(engine: str, busy: int, runs: list[tuple[float, float]], threads: int) -> BenchResult:
    """(seconds to the first token, seconds from the first token to the last) per run -> decode tokens/s."""
    decode = statistics.fmean((OUTPUT_LEN - 1) / d for _, d in runs)
    request = statistics.fmean(OUTPUT_LEN / (t + d) for t, d in runs)
    extra = {"decode_tokens_per_s": decode, "request_tokens_per_s": request, "busy": busy, "threads": threads,
             "runs": [list(run) for run in runs]}
    return BenchResult(engine, f"entrypoints-busy{busy}", sum(d for _, d in runs), (OUTPUT_LEN - 1) * len(runs),
                       batch=1, extra=extra)


def run_offline(llm, prompt: list[int], repetitions: int) -> list[tuple[float, float]]:
    from deepinfer.entrypoints.bench.workloads.llama_bench import time_request

    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    return [time_request(llm.engine, prompt, params) for _ in range(repetitions + 1)][1:]


def serve_command(args, port: int) -> list[str]:
    """`deepinfer serve` with the bench's model and the engine flags that change speed."""
    cmd = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--port", str(port), "--host", "127.0.0.1"]
    for flag, value in (("--model", args.model), ("--threads", args.threads), ("--dtype", args.dtype),
                        ("--quantization", args.quantization), ("--max-model-len", args.max_model_len),
                        ("--kv-cache-dtype", args.kv_cache_dtype), ("--activation-levels", args.activation_levels)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args) -> Iterator[str]:
    """A `deepinfer serve` child process, ready; yields its base URL and stops it after."""
    import httpx

    port = free_port()
    proc = subprocess.Popen(serve_command(args, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"deepinfer serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"deepinfer serve was not ready in {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_server(url: str, prompt: list[int], repetitions: int) -> list[tuple[float, float]]:
    import httpx

    from deepinfer.entrypoints.bench.workloads.serve import _send

    async def go() -> list[tuple[float, float]]:
        async with httpx.AsyncClient(base_url=url, timeout=None) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            runs = []
            for _ in range(repetitions + 1):
                r = await _send(client, model, prompt, OUTPUT_LEN)
                if not r.ok or r.output_tokens != OUTPUT_LEN:
                    raise RuntimeError(f"the server's request failed: {r.error or r.output_tokens}")
                runs.append((r.ttft, r.latency - r.ttft))
            return runs[1:]

    return asyncio.run(go())


def run_entrypoints(args) -> list[BenchResult]:
    """Offline and server on the same request, idle and (with --busy N) busy; prints each and the ratios."""
    repetitions = max(1, args.repetitions)
    threads = args.threads or os.cpu_count() or 1
    results = []
    with make_llm(args) as llm:
        prompt = prompt_ids(llm.engine.source.hf_config.vocab_size)
        for busy in dict.fromkeys([0, args.busy]):
            with busy_loops(busy):
                offline = result("deepinfer-offline", busy, run_offline(llm, prompt, repetitions), threads)
            with running_server(args) as url, busy_loops(busy):
                server = result("deepinfer-serve", busy, run_server(url, prompt, repetitions), threads)
            for r in (offline, server):
                print(f"entrypoints {r.engine:18s} busy {busy}: decode {r.extra['decode_tokens_per_s']:7.2f} tok/s, "
                      f"request {r.extra['request_tokens_per_s']:7.2f} tok/s ({repetitions} runs)", flush=True)
            ratio = offline.extra["decode_tokens_per_s"] / server.extra["decode_tokens_per_s"]
            print(f"entrypoints offline / server, busy {busy}: {ratio:.2f}x decode", flush=True)
            results += [offline, server]
    return results
