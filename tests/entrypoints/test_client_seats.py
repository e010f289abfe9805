"""Each client's seats bound its work in the engine, embeddings included (an in-process server over a
sentence-transformers checkpoint, its engine thread and tokenizer pool running as in `deepinfer serve`).

An embeddings request takes one seat of its client for its life and one more per input it has in the
engine beyond its first: with 3 seats per client, one client's 40-input request never has more than
3 inputs in the engine, its next request is a 429 while those seats are taken, and another client is
served meanwhile. An input too long for the context is a 400 unless the request asks to truncate
(Ollama's `truncate` included, whose own default would cut it)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from embedding_models import make_st_checkpoint
from server_probe import serve

from deepinfer import LLM

SEATS = 3


@pytest.fixture(scope="module")
def embed_llm(tmp_path_factory, tokenizer_dir):
    path = make_st_checkpoint(str(tmp_path_factory.mktemp("st") / "mean"), tokenizer_dir, "llama", "mean")
    return LLM(path, dtype="float32", max_model_len=64, max_num_seqs=8)


class InEngine:
    """The most embedding inputs of one request in the engine at once (added, not yet finished); an
    input's id is its request's id and its index (`embd-<hex>-<i>`)."""

    def __init__(self, engine, monkeypatch):
        self.open: set[str] = set()
        self.most = 0
        self.looked = threading.Event()  # set once the test has seen the full window
        add, step = engine.add_request, engine.step

        def counted_add(prompt_ids, params, request_id, **kwargs):
            result = add(prompt_ids, params, request_id, **kwargs)
            self.open.add(request_id)
            owner = request_id.rsplit("-", 1)[0]
            self.most = max(self.most, sum(r.rsplit("-", 1)[0] == owner for r in self.open))
            return result

        def counted_step():
            if self.most >= SEATS:  # the window is full: hold it so until the test has looked
                assert self.looked.wait(60)
            outputs = step()
            self.open -= {out.request_id for out in outputs if out.finished}
            return outputs

        monkeypatch.setattr(engine, "add_request", counted_add)
        monkeypatch.setattr(engine, "step", counted_step)


def serve_seated(llm, scenario, monkeypatch):
    """`scenario(app, mine, other)`: two clients (peer addresses) of a server with SEATS seats each."""
    return serve(llm, scenario, monkeypatch, clients=(("10.0.0.1", 1), ("10.0.0.2", 1)), max_requests_per_client=SEATS)


def test_an_embeddings_window_holds_no_more_than_the_clients_seats(embed_llm, monkeypatch):
    log = InEngine(embed_llm.engine, monkeypatch)

    async def scenario(app, mine, other):
        big = asyncio.create_task(mine.post("/v1/embeddings", json={"input": [f"text number {i}" for i in range(40)]}))
        while log.most < SEATS and not big.done():
            await asyncio.sleep(0.002)
        refused = await mine.post("/v1/embeddings", json={"input": "one more"})  # no seat: the engine is held
        log.looked.set()
        served = await other.post("/v1/embeddings", json={"input": "another client"})
        return await big, refused, served

    big, refused, served = serve_seated(embed_llm, scenario, monkeypatch)
    assert big.status_code == 200 and len(big.json()["data"]) == 40, big.text
    assert log.most == SEATS, log.most  # the window grew to the client's seats, and no further
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
    assert served.status_code == 200, served.text


def test_an_input_too_long_is_refused_unless_truncation_is_asked(embed_llm, monkeypatch):
    long = "word " * 500  # far more than max_model_len (64) tokens

    async def scenario(app, client, _):
        return [await client.post(path, json=body) for path, body in (
            ("/v1/embeddings", {"input": ["short", long]}),
            ("/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1}),
            ("/api/embed", {"model": "m", "input": ["short", long]}),
            ("/api/embed", {"model": "m", "input": long, "truncate": True}),
            ("/api/embeddings", {"model": "m", "prompt": long}))]

    openai_refused, openai_cut, ollama_refused, ollama_cut, legacy_refused = serve_seated(
        embed_llm, scenario, monkeypatch)
    assert openai_refused.status_code == 400 and openai_refused.json()["error"]["param"] == "input"
    assert "input[1]" in openai_refused.json()["error"]["message"]
    assert openai_cut.status_code == 200 and openai_cut.json()["usage"]["prompt_tokens"] == 64
    assert ollama_refused.status_code == 400 and "input[1]" in ollama_refused.json()["error"], ollama_refused.text
    assert ollama_cut.status_code == 200 and ollama_cut.json()["prompt_eval_count"] == 64, ollama_cut.text
    assert legacy_refused.status_code == 400 and "prompt" in legacy_refused.json()["error"], legacy_refused.text
