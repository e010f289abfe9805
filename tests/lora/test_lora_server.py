"""LoRA adapters over the OpenAI-compatible server (in process: tests/entrypoints/app_server.py).

Each adapter of `--lora-modules name=path` is a model in /v1/models with the base as its `parent`, and
a request's `model` picks it: its greedy text and logprobs are PEFT's with that adapter. With
`--allow-runtime-lora-updating`, /v1/load_lora_adapter and /v1/unload_lora_adapter change the set from
inside `--lora-dir` (a bad adapter, a taken or unknown name: 400 naming it; without the flag: 404).
Requests admitted with an adapter finish when it is unloaded meanwhile. Hostile adapters:
test_lora_hostile.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from lora_adapters import ADAPTER_SPECS, PeftReference, make_adapter, make_adapters

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
import app_server  # noqa: E402

PROMPT = list(range(300, 318))
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    from deepinfer.entrypoints.openai.args import lora_settings

    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = make_adapters(base, root)
    flags = ["--model", base, "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
             "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}", "--allow-runtime-lora-updating",
             "--lora-dir", str(tmp_path_factory.getbasetemp()),  # the runtime loads below read from tmp dirs
             "--max-model-len", "64", "--num-blocks", "64", "--block-size", "8"]
    plain = app_server.server_settings
    with pytest.MonkeyPatch.context() as mp:  # the LoRA flags reach the settings as `deepinfer serve` builds them
        mp.setattr(app_server, "server_settings", lambda args: dataclasses.replace(plain(args), **lora_settings(args)))
        with app_server.AppServer(*flags) as server:
            yield server, base, adapters, root, PeftReference(base, adapters)


def _complete(server, model: str | None, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "repetition_penalty": 1.0, "logprobs": 1,
            "ignore_eos": True}
    return server.client.post("/v1/completions", json=body if model is None else {**body, "model": model})


def _assert_peft(server, ref: PeftReference, adapter: str | None, response: httpx.Response) -> None:
    """The answer is PEFT's greedy continuation (text) with PEFT's logprobs (1e-4)."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    ids: list[int] = []
    for _ in range(MAX_TOKENS):  # PEFT's greedy tokens, one full forward each
        ids.append(int(ref.logprobs(adapter, PROMPT, ids + [0])[-1].argmax()))
    rows = ref.logprobs(adapter, PROMPT, ids)  # [n, V]
    assert choice["text"] == server.llm.get_tokenizer().decode(ids)
    expected = torch.tensor([float(rows[i, t]) for i, t in enumerate(ids)])
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, rtol=0, atol=1e-4)


def test_models_lists_each_adapter_with_its_parent(served):
    server, base, adapters, _, _ = served
    data = server.client.get("/v1/models").json()["data"]
    base_name = data[0]["id"]
    assert [m["id"] for m in data] == [base_name, "a", "b"]
    assert all(m["parent"] == base_name and m["root"] == m["id"] for m in data[1:])
    assert server.client.get("/v1/models/b").json()["parent"] == base_name


def test_the_model_field_picks_the_adapter(served):
    server, _, _, _, ref = served
    for model in ("a", "b"):
        response = _complete(server, model)
        _assert_peft(server, ref, model, response)
        assert response.json()["model"] == model
    _assert_peft(server, ref, None, _complete(server, None))
    assert _complete(server, "nope").status_code == 404
    chat = server.client.post("/v1/chat/completions", json={"model": "b", "max_tokens": 3, "messages": [
        {"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["model"] == "b"
    embedding = server.client.post("/v1/embeddings", json={"model": "b", "input": "hi"})
    assert embedding.status_code == 400 and "LoRA adapter" in embedding.json()["error"]["message"]


def test_load_and_unload_at_run_time(served, tmp_path):
    server, base, adapters, _, ref = served
    load = {"lora_name": "c", "lora_path": adapters["c"]}
    assert server.client.post("/v1/load_lora_adapter", json=load).status_code == 200
    assert "c" in [m["id"] for m in server.client.get("/v1/models").json()["data"]]
    _assert_peft(server, ref, "c", _complete(server, "c"))
    again = server.client.post("/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "'c'" in again.json()["error"]["message"]
    assert server.client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert _complete(server, "c").status_code == 404
    gone = server.client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 400 and "'c'" in gone.json()["error"]["message"]


@pytest.mark.parametrize("case", ["missing", "corrupt", "rank", "targets"])
def test_a_bad_adapter_is_a_400_naming_it(served, tmp_path, case):
    server, base, adapters, _, _ = served
    path = str(tmp_path / case)
    if case == "corrupt":
        make_adapter(base, path, r=4, targets=["q_proj"])
        (tmp_path / case / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    elif case == "rank":
        make_adapter(base, path, r=32, targets=["q_proj"])
    elif case == "targets":
        make_adapter(base, path, r=4, targets=["lm_head"])
    response = server.client.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{case}", "lora_path": path})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert f"bad-{case}" in message
    assert {"missing": "no such directory", "corrupt": "safetensors", "rank": "max_lora_rank=16",
            "targets": "lm_head"}[case] in message


@pytest.mark.slow
def test_without_runtime_updating_the_routes_do_not_exist(served):
    from deepinfer.entrypoints.openai.server import build_app

    server, _, adapters, _, _ = served
    settings = dataclasses.replace(app_server.server_settings(app_server.serve_args(["--model", "m"])),
                                   lora_modules=(("a", adapters["a"]),))
    app = build_app(server.llm.engine, settings)  # its lifespan never starts: no engine thread

    async def post() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"lora_name": "x", "lora_path": adapters["b"]}
            return (await client.post("/v1/load_lora_adapter", json=body)).status_code

    assert asyncio.run(post()) == 404
    bad = dataclasses.replace(settings, lora_modules=(("zz", str(Path(adapters["a"]).parent / "nowhere")),))
    with pytest.raises(ValueError, match="'zz'"):
        build_app(server.llm.engine, bad)
    with pytest.raises(ValueError, match="--enable-lora"):
        from deepinfer.entrypoints.openai.args import lora_settings

        lora_settings(app_server.serve_args(["--lora-modules", "a=/x"]))


def test_unloading_under_load_loses_no_request(served):
    """Six requests with adapter `a` run while `a` is unloaded and `d` loaded and unloaded: all finish."""
    server, base, adapters, root, _ = served
    state = server.app.state.server
    long_tokens = 24
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_complete, server, "a", long_tokens) for _ in range(6)]
        deadline = time.monotonic() + 60
        while state.engine_loop.num_active < 6:  # every request holds its adapter: handed to the engine
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.005)
        d = make_adapter(base, str(root / "d"), **{**ADAPTER_SPECS["b"], "seed": 31})
        assert server.client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert server.client.post("/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": d}).status_code == 200
        assert server.client.post("/v1/unload_lora_adapter", json={"lora_name": "d"}).status_code == 200
        responses = [f.result(timeout=120) for f in futures]
    assert [r.status_code for r in responses] == [200] * 6
    assert [r.json()["usage"]["completion_tokens"] for r in responses] == [long_tokens] * 6
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # the same adapter for all
    assert _complete(server, "a").status_code == 404
