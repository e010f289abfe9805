"""One rule for every route that embeds (/v1/embeddings, /api/embed, /api/embeddings, /v1/rerank,
/v1/score): a generative model that declares no pooling is refused on all of them with the same 400
naming `model` and --pooling; with `--pooling last` it serves all of them (and says so at start-up);
a model that declares a pooling (here a GGUF file's pooling_type) serves them without the flag.
/api/show lists the `embedding` capability exactly when the routes serve."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
from app_server import AppServer
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

NAME = "m"
TEXTS = ("a b", "ab ba")
ROUTES = (("/v1/embeddings", {"input": list(TEXTS)}), ("/api/embed", {"model": NAME, "input": list(TEXTS)}),
          ("/api/embeddings", {"model": NAME, "prompt": TEXTS[0]}),
          ("/v1/rerank", {"query": TEXTS[0], "documents": [TEXTS[1], TEXTS[0]]}),
          ("/v1/score", {"text_1": TEXTS[0], "text_2": list(TEXTS)}))


@pytest.fixture(scope="module")
def generative_gguf(tmp_path_factory) -> str:
    config = tiny_hf_config("llama")
    state = random_hf_model(config).state_dict()
    return write_gguf(tmp_path_factory.mktemp("gen") / "gen.gguf", "llama", config, state)


def _flags(path: str, *extra: str) -> list[str]:
    return ["--model", path, "--served-model-name", NAME, "--max-model-len", "64", "--dtype", "float32", *extra]


def _message(path: str, resp) -> str:
    """The refusal's text: OpenAI's error object naming `model`, or Ollama's {"error": text}."""
    assert resp.status_code == 400, (path, resp.text)
    error = resp.json()["error"]
    if path.startswith("/api/"):
        return error
    assert error["param"] == "model", (path, error)
    return error["message"]


def _capabilities(server) -> list[str]:
    return server.client.post("/api/show", json={"model": NAME}).json()["capabilities"]


def _served(server) -> dict:
    """Every route's answer (all 200), and the vectors agree across the routes."""
    answers = {}
    for path, body in ROUTES:
        resp = server.client.post(path, json=body)
        assert resp.status_code == 200, (path, resp.text)
        answers[path] = resp.json()
    vectors = np.array([row["embedding"] for row in answers["/v1/embeddings"]["data"]])  # [2, hidden]
    np.testing.assert_allclose(np.array(answers["/api/embed"]["embeddings"]), vectors, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(answers["/api/embeddings"]["embedding"], vectors[0], rtol=1e-5, atol=1e-6)
    cosine = vectors @ vectors[0] / np.linalg.norm(vectors, axis=1) / np.linalg.norm(vectors[0])  # [2]
    scores = [row["score"] for row in answers["/v1/score"]["data"]]
    np.testing.assert_allclose(scores, cosine, rtol=1e-4, atol=1e-5)
    return answers


@pytest.mark.slow
def test_a_generative_model_is_refused_alike_without_the_flag_and_served_with_it(generative_gguf, caplog):
    with AppServer(*_flags(generative_gguf)) as plain:
        messages = {path: _message(path, plain.client.post(path, json=body)) for path, body in ROUTES}
        assert len(set(messages.values())) == 1, messages  # the same words on every route
        assert "declares no pooling" in messages["/v1/rerank"] and "--pooling last|mean|cls" in messages["/v1/rerank"]
        assert "embedding" not in _capabilities(plain)
        free = plain.metrics()
        assert free["deepinfer_kv_free_blocks"] == free["deepinfer_kv_total_blocks"]
    caplog.set_level(logging.INFO, logger="deepinfer.engine")
    with AppServer(*_flags(generative_gguf, "--pooling", "last")) as pooled:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("embeddings:")]
        assert lines == ["embeddings: last pooling, L2-normalised (--pooling last: the model declares none)"]
        _served(pooled)
        assert "embedding" in _capabilities(pooled)


@pytest.mark.slow
def test_a_gguf_that_declares_its_pooling_serves_every_route(tmp_path):
    config = tiny_hf_config("llama")
    extra = {"llama.pooling_type": (1, gguf.GGUFValueType.UINT32)}  # llama.cpp's MEAN
    path = write_gguf(tmp_path / "emb.gguf", "llama", config, random_hf_model(config).state_dict(), extra=extra)
    with AppServer(*_flags(path)) as server:
        pooling = server.app.state.server.engine.pooling
        assert (pooling.pooling_type, pooling.source, pooling.serves) == ("mean", "GGUF pooling_type mean", True)
        _served(server)
        assert "embedding" in _capabilities(server)
    ranked = write_gguf(tmp_path / "rank.gguf", "llama", config, random_hf_model(config).state_dict(),
                        extra={"llama.pooling_type": (4, gguf.GGUFValueType.UINT32)})  # RANK: not computed here
    with AppServer(*_flags(ranked)) as server:
        message = _message("/v1/embeddings", server.client.post("/v1/embeddings", json={"input": "a"}))
        assert "GGUF pooling_type 'rank' is not computed here" in message
        assert "embedding" not in _capabilities(server)
