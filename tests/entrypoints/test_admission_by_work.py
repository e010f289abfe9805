"""Admission by work, against an in-process server (the app over httpx's ASGI transport, its engine
thread and tokenizer pool running as in `deepinfer serve`): the probe's 2,048 one-token embedding
inputs leave room for a concurrent completion, two 7.5 MB /tokenize calls do not delay another
completion's first token, big bodies have a pool lane of their own, the 429 goes to the client
over its share, and the tokenizer routes pass the capacity check. "Within 2 s" is counted as work
(engine steps, characters tokenized), not timed; the seconds are printed for the record."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from embedding_models import make_st_checkpoint
from server_probe import StepLog, serve

from deepinfer import LLM
from deepinfer.serving.engine_loop import EngineLoop

CMPL = "/v1/completions"
BODY = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
BIG_TEXT = ("hello world " * 700_000)[:7_500_000]  # 7.5 MB


@pytest.fixture(scope="module")
def embed_llm(tmp_path_factory, tokenizer_dir):
    path = make_st_checkpoint(str(tmp_path_factory.mktemp("st") / "mean"), tokenizer_dir, "llama", "mean")
    return LLM(path, dtype="float32", max_model_len=512, max_num_seqs=8)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("llama"), max_num_seqs=8)


async def _timed_post(client, path: str, body: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    resp = await client.post(path, json=body)
    return resp, time.monotonic() - start


def test_2048_one_token_embedding_inputs_leave_room_for_a_completion(embed_llm, monkeypatch):
    """The probe's {"input": [[5]] * 2048} beside a completion: the completion is a 200, and reaches
    its first token within a couple of engine steps of entering the engine (the embedding request
    holds a window of the queue, not 2,048 places; on main it got a 429)."""
    log = StepLog(embed_llm.engine, monkeypatch)

    async def scenario(app, client):
        baseline, baseline_s = await _timed_post(client, CMPL, BODY)
        embed = asyncio.create_task(client.post("/v1/embeddings", json={"input": [[5]] * 2048}))
        while not any(r.startswith("embd-") for r in log.first_output) and not embed.done():
            await asyncio.sleep(0.005)
        completion, concurrent_s = await _timed_post(client, CMPL, {**BODY, "prompt": "Another prompt"})
        embeddings_done = sum(r.startswith("embd-") for r in log.first_output)
        return baseline, baseline_s, completion, concurrent_s, await embed, embeddings_done

    baseline, baseline_s, completion, concurrent_s, embed, embeddings_done = serve(embed_llm, scenario, monkeypatch)
    print(f"\nembeddings: completion alone {baseline_s:.3f} s, beside 2,048 inputs {concurrent_s:.3f} s "
          f"({embeddings_done} inputs done by then)")
    assert baseline.status_code == 200, baseline.text
    assert completion.status_code == 200, completion.text
    assert embed.status_code == 200, embed.text
    assert [item["index"] for item in embed.json()["data"]] == list(range(2048))
    # window (8 = max_num_seqs) waiting inputs ahead of it at most: one step for them, one prefill
    steps = log.steps_to_first_output(completion.json()["id"])
    assert steps <= 3, steps
    assert embeddings_done < 2048  # it really ran beside them


@pytest.mark.slow
def test_two_7_5_mb_tokenize_calls_do_not_delay_a_completion(llm, monkeypatch):
    """The probe's two 7.5 MB /tokenize calls, then a streamed completion: no big text is tokenized
    before the completion's first token (on main both took the pool's two workers and 15 MB were
    tokenized first); the texts cannot fit the context, so each is a 400 without being tokenized."""
    tokenizer_cls = type(llm.get_tokenizer())
    tokenized: list[int] = []  # characters of each text the tokenizers were given
    original = tokenizer_cls.__call__

    def counting_call(self, text=None, *args, **kwargs):
        tokenized.append(len(text) if isinstance(text, str) else 0)
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_cls, "__call__", counting_call)

    async def first_token(client, body) -> tuple[float, int]:
        start = time.monotonic()
        async with client.stream("POST", CMPL, json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return time.monotonic() - start, sum(tokenized)
        raise AssertionError("no token")

    async def scenario(app, client):
        baseline_s, _ = await first_token(client, BODY)
        pool = app.state.server.pool
        big = [asyncio.create_task(client.post("/tokenize", json={"prompt": BIG_TEXT})) for _ in range(2)]
        while pool.pending < 2 and not all(task.done() for task in big):
            await asyncio.sleep(0.001)
        before = sum(tokenized)
        concurrent_s, chars_at_first_token = await first_token(client, {**BODY, "prompt": "Another prompt"})
        return baseline_s, concurrent_s, chars_at_first_token - before, await asyncio.gather(*big)

    baseline_s, concurrent_s, chars, answers = serve(llm, scenario, monkeypatch)
    print(f"\ntokenize: first token alone {baseline_s:.3f} s, beside two 7.5 MB /tokenize calls "
          f"{concurrent_s:.3f} s ({chars} characters tokenized before it)")
    assert chars < 10_000, chars
    for resp in answers:
        assert resp.status_code == 400, resp.status_code
        error = resp.json()["error"]
        assert error["param"] == "prompt" and error["code"] == "context_length_exceeded", error
    assert max(tokenized) < 10_000  # the 7.5 MB texts were never tokenized


def test_big_bodies_have_a_lane_of_their_own(llm):
    """Two big jobs blocked in the pool do not hold up a small one; a third big one is a 429."""
    from deepinfer.serving.errors import ServingError
    from deepinfer.serving.pool import TokenizerPool

    release = threading.Event()

    def job(tokenizer, body: bytes) -> int:
        if len(body) > 100:
            assert release.wait(60)
        return len(tokenizer(body.decode())["input_ids"])

    async def main():
        pool = TokenizerPool(llm.get_tokenizer(), 2, big_job_bytes=100, max_big_jobs=2)
        try:
            big = [asyncio.create_task(pool.run(job, b"x " * 100)) for _ in range(2)]
            await asyncio.sleep(0)
            small = await asyncio.wait_for(pool.run(job, b"hello"), 60)
            blocked = not any(task.done() for task in big)
            with pytest.raises(ServingError) as refused:
                await pool.run(job, b"y " * 100)
            release.set()
            return small, blocked, refused.value, await asyncio.gather(*big)
        finally:
            release.set()
            pool.shutdown()

    small, blocked, refused, big = asyncio.run(main())
    assert small >= 1 and blocked and all(n >= 100 for n in big)
    assert refused.status_code == 429 and refused.code == "queue_full", refused.message()
    assert "over 100 bytes" in refused.message() and "limit 2" in refused.message()


def test_the_429_goes_to_the_client_over_its_share(llm, monkeypatch):
    """One address holds its 2 requests in flight: its third is a 429 naming the per-client limit,
    while another address is still served."""
    long = {**BODY, "max_tokens": llm.engine.max_model_len - 16, "stream": True}

    async def scenario(app, greedy, other):
        loop = app.state.server.engine_loop
        streams = [asyncio.create_task(greedy.post(CMPL, json=long)) for _ in range(2)]
        while loop.num_active < 2:  # both in the engine (they run until aborted below)
            await asyncio.sleep(0.005)
        third = await greedy.post(CMPL, json=BODY)
        served = await other.post(CMPL, json=BODY)
        loop.abort_all()
        return [s.status_code for s in await asyncio.gather(*streams)], third, served

    statuses, third, served = serve(llm, scenario, monkeypatch, clients=(("10.0.0.1", 1), ("10.0.0.2", 1)),
                                    max_requests_per_client=2)
    assert statuses == [200, 200]
    assert third.status_code == 429 and "retry-after" in third.headers, third.text
    error = third.json()["error"]
    assert error["code"] == "queue_full" and "limit 2 per client" in error["message"], error
    assert served.status_code == 200, served.text


def test_the_tokenizer_routes_pass_the_capacity_check_and_the_input_limits(llm, monkeypatch):
    """/tokenize and /detokenize get the 429 a completion gets while the queue is full; more tokens
    than max_model_len are a 400 naming the field."""
    max_len = llm.engine.max_model_len

    async def scenario(app, client):
        too_many = await client.post("/detokenize", json={"tokens": [5] * (max_len + 1)})
        with monkeypatch.context() as patch:
            patch.setattr(EngineLoop, "num_waiting", property(lambda self: 10**6))
            full = [await client.post(path, json=body) for path, body in
                    (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]}), (CMPL, BODY))]
        return too_many, full

    too_many, full = serve(llm, scenario, monkeypatch)
    assert too_many.status_code == 400, too_many.text
    assert too_many.json()["error"]["param"] == "tokens" and str(max_len) in too_many.json()["error"]["message"]
    for resp in full:
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full", resp.text


def test_max_requests_per_client_is_a_serve_flag():
    """`deepinfer serve --max-requests-per-client N` reaches the settings; 0 is refused naming the flag."""
    from app_server import serve_args, server_settings

    from deepinfer.entrypoints.openai.launcher import _check_args

    assert server_settings(serve_args(["--max-requests-per-client", "3"])).max_requests_per_client == 3
    assert server_settings(serve_args([])).max_requests_per_client is None
    with pytest.raises(ValueError, match=r"--max-requests-per-client must be >= 1, got 0"):
        _check_args(serve_args(["--max-requests-per-client", "0"]))


def test_an_input_added_while_its_window_aborts_is_aborted_too():
    """A client that leaves while an input is being added: that input's handle, stored after the
    abort, is aborted as soon as the add returns (it used to run to its end, holding the answer)."""
    from deepinfer.serving.embeddings import InputWindow

    class Handle:
        aborted = False

        def abort(self):
            self.aborted = True

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.aborted:
                raise StopAsyncIteration
            await asyncio.sleep(0.01)
            return None

    class Loop:
        def __init__(self):
            self.adding, self.release, self.handle = asyncio.Event(), asyncio.Event(), Handle()

        async def add(self, *args, **kwargs):
            self.adding.set()
            await self.release.wait()
            return self.handle

    async def main():
        loop = Loop()
        window = InputWindow(loop, "embd-x", None, size=1, paths=[("input", 0)])
        run = asyncio.create_task(window.run([[5]]))
        await loop.adding.wait()
        window.abort()  # the client went away while the add was in flight
        loop.release.set()
        await asyncio.wait_for(run, 5)
        return loop.handle.aborted

    assert asyncio.run(main())
