"""POST /v1/embeddings on the app in this process: parity with sentence-transformers on a batch of
64 inputs (the longest chunked), every input form, base64 and the official client, Matryoshka
`dimensions`, a completion running beside a batch, and bad requests answered 400 naming the field
while another batch goes on, with every block free afterwards."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import numpy as np
import pytest
from app_server import AppServer
from embedding_models import cosines, make_st_checkpoint, st_inputs, st_reference

pytestmark = [pytest.mark.parity]

MODEL = "tiny-embed"
FLAGS = ("--dtype", "float32", "--max-num-batched-tokens", "64", "--max-model-len", "512",
         "--served-model-name", MODEL)


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory, tokenizer_dir) -> str:
    return make_st_checkpoint(str(tmp_path_factory.mktemp("st") / "mean"), tokenizer_dir, "llama", "mean")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return st_inputs(64)


@pytest.fixture(scope="module")
def reference(st_dir, texts) -> np.ndarray:
    return st_reference(st_dir, texts)


@pytest.fixture(scope="module")
def server(st_dir):
    with AppServer("--model", st_dir, *FLAGS) as server:
        yield server


def _post(server, body: dict, status: int = 200) -> dict:
    resp = server.client.post("/v1/embeddings", json=body)
    assert resp.status_code == status, resp.text
    return resp.json()


def _vectors(answer: dict) -> np.ndarray:
    assert [item["index"] for item in answer["data"]] == list(range(len(answer["data"])))
    return np.array([item["embedding"] for item in answer["data"]], dtype=np.float64)


def test_a_batch_of_64_matches_sentence_transformers_beside_a_completion(server, st_dir, texts, reference):
    from transformers import AutoTokenizer

    completion = {"model": MODEL, "prompt": texts[62], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = server.client.post("/v1/completions", json=completion).json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        generating = pool.submit(server.client.post, "/v1/completions", json=completion)
        answer = _post(server, {"model": MODEL, "input": texts})
        assert generating.result().json()["choices"][0]["text"] == alone
    ours = _vectors(answer)
    assert cosines(ours, reference).min() >= 0.9999
    np.testing.assert_allclose(ours, reference, atol=1e-5)  # measured: < 4e-7
    tokenizer = AutoTokenizer.from_pretrained(st_dir)
    num_tokens = [len(tokenizer(t)["input_ids"]) for t in texts]
    assert max(num_tokens) > 3 * 64  # chunked prefill
    assert answer["usage"] == {"prompt_tokens": sum(num_tokens), "total_tokens": sum(num_tokens)}
    assert (answer["object"], answer["model"], answer["data"][0]["object"]) == ("list", MODEL, "embedding")


def test_input_forms_base64_and_the_official_client(server, st_dir, texts, reference):
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(st_dir)(t)["input_ids"] for t in texts[:3]]
    one = _vectors(_post(server, {"input": texts[0]}))
    as_ids = _vectors(_post(server, {"input": ids[0]}))
    many_ids = _vectors(_post(server, {"input": ids}))
    assert np.array_equal(one, as_ids) and np.array_equal(many_ids[:1], one)
    assert cosines(many_ids, reference[:3]).min() >= 0.9999

    floats = _vectors(_post(server, {"input": texts[:3], "encoding_format": "float"}))
    packed = _post(server, {"input": texts[:3], "encoding_format": "base64"})["data"]
    decoded = np.array([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in packed])
    assert decoded.shape == (3, 64) and np.array_equal(decoded, floats)  # every value is a float32

    client = server.openai()
    via_client = client.embeddings.create(model=MODEL, input=texts[:3])  # asks for base64 by default
    assert np.array_equal(np.array([d.embedding for d in via_client.data]), floats)
    assert via_client.usage.prompt_tokens == sum(len(i) for i in ids)


def test_dimensions_where_the_model_declares_matryoshka(server, st_dir, texts, reference):
    answer = _post(server, {"input": texts[:2], "dimensions": 16}, status=400)
    assert answer["error"]["param"] == "dimensions" and "Matryoshka" in answer["error"]["message"]
    with AppServer("--model", st_dir, *FLAGS, "--hf-overrides", '{"is_matryoshka": true}') as matryoshka:
        short = _vectors(_post(matryoshka, {"input": texts[:8], "dimensions": 16}))
        too_long = _post(matryoshka, {"input": "a", "dimensions": 65}, status=400)
    expected = reference[:8, :16] / np.linalg.norm(reference[:8, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(short, expected, atol=1e-5)
    assert too_long["error"]["param"] == "dimensions"


BAD = [  # (body, status, param)
    ({}, 400, "input"), ({"input": ""}, 400, "input"), ({"input": []}, 400, "input"), ({"input": [""]}, 400, "input"),
    ({"input": [[]]}, 400, "input"), ({"input": ["a", 1]}, 400, "input"), ({"input": [[1, "a"]]}, 400, "input"),
    ({"input": [1.5]}, 400, "input"), ({"input": [True]}, 400, "input"), ({"input": None}, 400, "input"),
    ({"input": {"text": "a"}}, 400, "input"), ({"input": [[49152]]}, 400, "input"), ({"input": [-1]}, 400, "input"),
    ({"input": [[5] * 513]}, 400, "input"), ({"input": ["a"] * 2049}, 400, "input"),
    ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format"), ({"input": "a", "dimensions": 0}, 400,
                                                                         "dimensions"),
    ({"input": "a", "dimensions": True}, 400, "dimensions"), ({"input": "a", "dimensions": 8}, 400, "dimensions"),
    ({"input": "a", "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ({"input": "a", "normalize": "yes"}, 400, "normalize"), ({"input": "a", "bogus": 1}, 400, "bogus"),
    ({"input": "a", "model": "other"}, 404, "model"),
]


def test_bad_requests_name_the_field_and_leave_the_rest_whole(server, texts, reference):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        good = pool.submit(server.client.post, "/v1/embeddings", json={"input": texts})
        for body, status, param in BAD:
            error = _post(server, body, status=status)["error"]
            assert error["param"] == param, (body, error)
            assert set(error) == {"message", "type", "param", "code"}
        answer = good.result()
    assert answer.status_code == 200 and cosines(_vectors(answer.json()), reference).min() >= 0.9999
    too_long = _post(server, {"input": [[5] * 513]}, status=400)["error"]
    assert too_long["code"] == "context_length_exceeded" and "input[0]: has 513 tokens" in too_long["message"]
    fits = _post(server, {"input": [[5] * 513], "truncate_prompt_tokens": 512})
    assert fits["usage"]["prompt_tokens"] == 512
    metrics = server.metrics()
    assert metrics["deepinfer_kv_free_blocks"] == metrics["deepinfer_kv_total_blocks"] > 0
    assert metrics["deepinfer_num_requests_running"] == metrics["deepinfer_num_requests_waiting"] == 0
    assert json.loads(server.client.get("/health").text) == {"status": "ok"}
