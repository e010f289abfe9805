"""POST /v1/rerank (and its /rerank, /v2/rerank aliases) and /v1/score on the app in this process,
over a tiny sentence-transformers checkpoint: every score is the cosine of the two texts' vectors
from /v1/embeddings (computed here with numpy) and of sentence-transformers' own `similarity`;
order, top_n and return_documents; 1:1, 1:N and N:N pairs; bad bodies are 400s naming the field;
a generative model without pooling is a 400 naming `model`."""

from __future__ import annotations

import numpy as np
import pytest
from app_server import AppServer
from embedding_models import make_st_checkpoint, st_inputs

MODEL = "tiny-embed"
FLAGS = ("--dtype", "float32", "--max-num-batched-tokens", "64", "--max-model-len", "256",
         "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory, tokenizer_dir) -> str:
    return make_st_checkpoint(str(tmp_path_factory.mktemp("st") / "mean"), tokenizer_dir, "llama", "mean",
                              normalize=False)


@pytest.fixture(scope="module")
def server(st_dir):
    with AppServer("--model", st_dir, *FLAGS) as server:
        yield server


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return st_inputs(9, seed=3)[:9]


def _post(server, path: str, body: dict, status: int = 200) -> dict:
    resp = server.client.post(path, json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def _embed(server, texts: list[str]) -> np.ndarray:
    data = _post(server, "/v1/embeddings", {"input": texts})["data"]
    return np.array([item["embedding"] for item in data], dtype=np.float64)


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of every row of a [N, D] with every row of b [M, D]: [N, M]."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a @ b.T


def test_rerank_orders_documents_by_the_cosine_of_their_embeddings(server, st_dir, texts):
    query, documents = texts[0], texts[1:]
    expected = _cosine(_embed(server, [query]), _embed(server, documents))[0]
    answer = _post(server, "/v1/rerank", {"model": MODEL, "query": query, "documents": documents})
    results = answer["results"]
    assert [r["index"] for r in results] == sorted(range(len(documents)), key=lambda i: -expected[i])
    np.testing.assert_allclose([r["relevance_score"] for r in results], expected[[r["index"] for r in results]],
                               atol=1e-9)
    assert all(r["document"] == {"text": documents[r["index"]]} for r in results)
    assert answer["model"] == MODEL and answer["id"].startswith("rerank-")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(st_dir)
    assert answer["usage"] == {"total_tokens": sum(len(tokenizer(t)["input_ids"]) for t in texts)}
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(st_dir, device="cpu")
    theirs = model.similarity(model.encode([query]), model.encode(documents)).numpy()[0]
    np.testing.assert_allclose([r["relevance_score"] for r in results], theirs[[r["index"] for r in results]],
                               atol=1e-5)
    assert expected.max() - expected.min() > 1e-3  # the order is not a tie


def test_top_n_return_documents_object_documents_and_aliases(server, texts):
    query, documents = texts[0], texts[1:]
    full = _post(server, "/v1/rerank", {"query": query, "documents": documents})["results"]
    top = _post(server, "/rerank", {"query": query, "documents": [{"text": d} for d in documents], "top_n": 3,
                                    "return_documents": False})["results"]
    assert [(r["index"], r["relevance_score"]) for r in top] == [(r["index"], r["relevance_score"]) for r in full[:3]]
    assert all(set(r) == {"index", "relevance_score"} for r in top)
    more = _post(server, "/v2/rerank", {"query": query, "documents": documents[:2], "top_n": 10})["results"]
    assert sorted(r["index"] for r in more) == [0, 1]


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(server, texts):
    vectors = _embed(server, texts[:6])
    matrix = _cosine(vectors, vectors)
    one = _post(server, "/v1/score", {"model": MODEL, "text_1": texts[0], "text_2": texts[1]})
    assert one["object"] == "list" and one["model"] == MODEL and one["data"][0]["object"] == "score"
    np.testing.assert_allclose([d["score"] for d in one["data"]], [matrix[0, 1]], atol=1e-9)
    many = _post(server, "/score", {"text_1": [texts[0]], "text_2": texts[1:6]})["data"]
    assert [d["index"] for d in many] == list(range(5))
    np.testing.assert_allclose([d["score"] for d in many], matrix[0, 1:6], atol=1e-9)
    pairs = _post(server, "/v1/score", {"text_1": texts[:3], "text_2": texts[3:6]})
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], [matrix[i, i + 3] for i in range(3)],
                               atol=1e-9)
    assert pairs["usage"]["prompt_tokens"] == pairs["usage"]["total_tokens"] > 0


BAD = [  # (path, body, status, param)
    ("/v1/rerank", {"query": "a", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b", ""]}, 400, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["b"]}, 400, "query"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, 400, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": True}, 400, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": [1]}, 400, "documents"),
    ("/v1/rerank", {"query": "a", "documents": [{"txt": "b"}]}, 400, "documents"),
    ("/v1/rerank", {"query": ["a"], "documents": ["b"]}, 400, "query"),
    ("/v1/rerank", {"documents": ["b"]}, 400, "query"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "return_documents": "yes"}, 400, "return_documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "bogus": 1}, 400, "bogus"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "other"}, 404, "model"),
    ("/v1/rerank", {"query": "a", "documents": ["b"] * 2048}, 400, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["word " * 300]}, 400, "documents"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": ["c"]}, 400, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, 400, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": [""]}, 400, "text_2"),
    ("/v1/score", {"text_1": 1, "text_2": "b"}, 400, "text_1"),
    ("/v1/score", {"text_1": "a"}, 400, "text_2"),
]


def test_bad_bodies_name_the_field_and_leave_every_block_free(server):
    for path, body, status, param in BAD:
        error = _post(server, path, body, status=status)["error"]
        assert error["param"] == param, (path, body, error)
    metrics = server.metrics()
    assert metrics["deepinfer_kv_free_blocks"] == metrics["deepinfer_kv_total_blocks"] > 0


@pytest.mark.slow
def test_a_generative_model_without_pooling_is_refused_naming_model(tiny_checkpoint):
    with AppServer("--model", tiny_checkpoint("llama"), "--max-model-len", "96") as generative:
        for path, body in (("/v1/rerank", {"query": "a", "documents": ["b"]}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"})):
            error = _post(generative, path, body, status=400)["error"]
            assert error["param"] == "model" and "declares no pooling" in error["message"], error
