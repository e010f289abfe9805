"""Prefix caching through the user-facing APIs: dict prompts with a cache_salt in
`LLM.generate`, the CLI flags, `deepinfer info --kv-cache-dir`, and the OpenAI server's
cache_salt, `usage.prompt_tokens_details.cached_tokens`, /metrics counters (the app in this
process) and the flush of the cache directory when a `deepinfer serve` process gets SIGTERM (a
restarted server reads it)."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from app_server import AppServer
from live_server import LiveServer

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.engine_args import cache_config
from deepinfer.llm import _as_prompt_list
from deepinfer.serving.metrics import EngineStats, ServerMetrics

TEXT = "The quick brown fox jumps over the lazy dog. " * 6  # > 3 blocks of 16 tokens
IDS = [(7 * i) % 500 + 5 for i in range(40)]  # 40 token ids: 2 full blocks can hit
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from deepinfer import LLM

    with LLM(tiny_checkpoint("llama"), num_blocks=64) as llm:
        yield llm


def _params(max_tokens: int = 3):
    from deepinfer import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# -- LLM.generate with dict prompts ----------------------------------------------------------------


def test_same_salt_shares_the_cache_and_another_salt_does_not(llm):
    first = llm.generate({"prompt": TEXT, "cache_salt": "alice"}, _params(), use_tqdm=False)[0]
    again, other, unsalted = llm.generate([{"prompt": TEXT, "cache_salt": "alice"},
                                           {"prompt": TEXT, "cache_salt": "bob-" + TEXT[:8]},
                                           TEXT], _params(), use_tqdm=False)
    assert first.error is None and first.num_cached_tokens == 0
    assert first.prompt == TEXT and len(first.prompt_token_ids) > 32
    assert 0 < again.num_cached_tokens < len(again.prompt_token_ids)
    assert again.num_cached_tokens % 16 == 0  # whole blocks
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids  # greedy: a hit changes nothing


def test_token_id_dicts_take_a_salt_too(llm):
    outs = llm.generate([{"prompt_token_ids": IDS, "cache_salt": "ids"}], _params(), use_tqdm=False)
    again = llm.generate({"prompt_token_ids": tuple(IDS), "cache_salt": "ids"}, _params(), use_tqdm=False)[0]
    plain = llm.generate({"prompt_token_ids": IDS}, _params(), use_tqdm=False)[0]  # no salt: its own chain
    assert outs[0].num_cached_tokens == 0 and outs[0].prompt_token_ids == IDS
    assert again.num_cached_tokens == 32 and again.prompt_token_ids == IDS
    assert plain.num_cached_tokens == 0


BAD_DICTS = [  # (name, prompt, words the error names): refused before anything runs
    ("neither key", {"cache_salt": "s"}, ["prompt", "prompt_token_ids", "neither"]),
    ("both keys", {"prompt": "hi", "prompt_token_ids": [5, 6]}, ["prompt", "prompt_token_ids", "both"]),
    ("unknown key", {"prompt": "hi", "priority": 3}, ["'priority'"]),
    ("prompt not a string", {"prompt": [5, 6]}, ["prompt", "[5, 6]"]),
    ("ids not ints", {"prompt_token_ids": ["a", "b"]}, ["prompt_token_ids", "['a', 'b']"]),
    ("not a prompt at all", 3.5, ["prompt", "3.5"]),
    ("None", None, ["prompt", "None"]),
]
BAD_SALTS = [  # (prompt, words the error names): the engine refuses these alone while the batch runs
    ({"prompt": "hi", "cache_salt": 5}, ["cache_salt", "5"]),
    ({"prompt_token_ids": [5, 6], "cache_salt": ["a"]}, ["cache_salt", "['a']"]),
]


@pytest.mark.parametrize("name, prompt, words", BAD_DICTS, ids=[c[0] for c in BAD_DICTS])
def test_malformed_prompts_raise_naming_the_index_before_anything_runs(llm, name, prompt, words):
    before = llm.get_metrics()
    with pytest.raises(ValueError) as err:
        llm.generate([{"prompt": "Hello there"}, "fine", prompt], _params(), use_tqdm=False)
    assert str(err.value).startswith("prompts[2]: ") and all(w in str(err.value) for w in words), str(err.value)
    assert llm.get_metrics() == before and not llm.engine.has_unfinished_requests()  # nothing was queued
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_bad_salts_are_refused_naming_the_prompt_and_the_field(llm):
    good = {"prompt": "Hello there", "cache_salt": "ok"}
    for bad, words in BAD_SALTS:
        with pytest.raises(ValueError) as exc:
            llm.generate([good, bad], _params(), use_tqdm=False)
        assert str(exc.value).startswith("prompts[1]: ") and all(w in str(exc.value) for w in words), exc.value
        assert not llm.engine.has_unfinished_requests()
    out = llm.generate([good], _params(), use_tqdm=False)[0]
    assert out.error is None and out.finished and len(out.outputs[0].token_ids) == 3
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_a_single_dict_prompt_runs_its_text_and_stream_takes_dicts(llm):
    by_text = llm.generate("The capital of France is", _params(), use_tqdm=False)[0]
    by_dict = llm.generate({"prompt": "The capital of France is"}, _params(), use_tqdm=False)[0]
    assert by_dict.prompt == "The capital of France is" and by_dict.prompt_token_ids == by_text.prompt_token_ids
    assert by_dict.outputs[0].token_ids == by_text.outputs[0].token_ids
    streamed = list(llm.stream({"prompt_token_ids": IDS, "cache_salt": "s"}, _params()))
    assert streamed[-1].finished and streamed[-1].prompt_token_ids == IDS
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.stream({"prompt_token_ids": "abc"}, _params()).__next__()


def test_as_prompt_list_keeps_a_single_dict_whole():
    one = {"prompt": "hi", "cache_salt": "s"}
    assert _as_prompt_list(one) == [one]
    assert _as_prompt_list([one, "x"]) == [one, "x"]
    assert _as_prompt_list([1, 2]) == [[1, 2]] and _as_prompt_list("hi") == ["hi"]


# -- CLI flags -------------------------------------------------------------------------------------


def _args(*flags: str):
    return cli.build_parser().parse_args(["serve", *flags])


def test_prefix_flags_default_to_on_in_memory():
    cfg = cache_config(_args())
    assert cfg.enable_prefix_caching is True and cfg.kv_cache_dir is None
    assert cfg.kv_cache_dir_size == 4 * 2**30 and cfg.prefix_snapshot_interval == 512
    assert cfg.num_prefix_snapshots is None


@pytest.mark.parametrize("sub", ["generate x", "chat", "info", "bench", "serve"])
def test_prefix_flags_reach_the_cache_config(sub, tmp_path):
    args = cli.build_parser().parse_args([*sub.split(), "--no-enable-prefix-caching", "--kv-cache-dir",
                                          str(tmp_path), "--kv-cache-dir-size", "512MiB",
                                          "--prefix-snapshot-interval", "256", "--num-prefix-snapshots", "3"])
    cfg = cache_config(args)
    assert (cfg.enable_prefix_caching, cfg.kv_cache_dir, cfg.kv_cache_dir_size, cfg.prefix_snapshot_interval,
            cfg.num_prefix_snapshots) == (False, str(tmp_path), 512 * 2**20, 256, 3)
    assert cache_config(cli.build_parser().parse_args([*sub.split(), "--enable-prefix-caching"])).enable_prefix_caching


@pytest.mark.parametrize("flags, field", [
    (["--kv-cache-dir-size", "lots"], "kv_cache_dir_size"),
    (["--kv-cache-dir-size", "0"], "kv_cache_dir_size"),
    (["--prefix-snapshot-interval", "0"], "prefix_snapshot_interval"),
    (["--num-prefix-snapshots", "-1"], "num_prefix_snapshots"),
    (["--kv-cache-dir", ""], "kv_cache_dir"),
])
def test_bad_prefix_flags_are_a_clear_error_before_loading(flags, field, capsys, monkeypatch):
    import deepinfer.llm

    def no_load(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(deepinfer.llm, "build_engine", no_load)
    assert cli.main(["info", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error: ") and field in err and "Traceback" not in err


def test_an_unwritable_cache_dir_is_a_clear_error(tiny_checkpoint, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert cli.main(["info", "--model", tiny_checkpoint("llama"), "--num-blocks", "16", "--max-model-len", "256",
                     "--kv-cache-dir", str(blocker / "cache")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deepinfer: error: ") and "kv_cache_dir" in err and "Traceback" not in err


def test_info_lists_the_cache_dir(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "0123456789abcdef"
    folder.mkdir()
    (folder / "aa.paged.safetensors").write_bytes(b"x" * 1000)
    (folder / "bb.snapshot.safetensors").write_bytes(b"y" * 2048)
    (tmp_path / "notes.txt").write_text("not a cache file")
    assert cli.main(["info", "--model", tiny_checkpoint("llama"), "--num-blocks", "16", "--max-model-len", "256",
                     "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-size", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "prefix caching: on" in out
    assert f"kv cache dir: {tmp_path}: 2 entries, 3.0 KiB of 1.0 MiB" in out
    assert "model 0123456789abcdef: 2 entries, 3.0 KiB" in out
    assert "(this model): nothing saved yet" in out


# -- the OpenAI server -----------------------------------------------------------------------------


def test_prefix_counters_on_metrics_move_by_deltas():
    metrics = ServerMetrics()
    metrics.record_engine(EngineStats(prefix_queries=40, prefix_hits=32, prefix_disk_hits=16, num_cached_blocks=5,
                                      kv_dir_bytes_read=100, kv_dir_bytes_written=300, prefix_load_failures=1))
    metrics.record_engine(EngineStats())  # the empty snapshot after the engine stops: counters stay
    value = metrics.registry.get_sample_value
    assert value("deepinfer_prefix_cache_queries_total") == 40
    assert value("deepinfer_prefix_cache_hits_total") == 32
    assert value("deepinfer_prefix_cache_disk_hits_total") == 16
    assert value("deepinfer_prefix_cache_load_failures_total") == 1
    assert value("deepinfer_kv_cache_dir_bytes_read_total") == 100
    assert value("deepinfer_kv_cache_dir_bytes_written_total") == 300
    assert value("deepinfer_num_cached_blocks") == 0


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    cache_dir = str(tmp_path_factory.mktemp("kv-cache-dir"))
    with AppServer("--model", tiny_checkpoint("llama"), "--num-blocks", "64", "--kv-cache-dir", cache_dir) as server:
        yield server


def _post(server: LiveServer | AppServer, path: str, body: dict) -> httpx.Response:
    if isinstance(server, AppServer):
        return server.client.post(path, json=body)
    return httpx.post(server.url + path, json=body, timeout=60)


def _cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.slow
def test_server_cache_salt_and_cached_tokens(server):
    body = {"prompt": IDS, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_salt": "tenant-1"}
    assert _cached(_post(server, CMPL, body)) == 0
    assert _cached(_post(server, CMPL, body)) == 32
    assert _cached(_post(server, CMPL, body | {"cache_salt": "tenant-2"})) == 0
    chat = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 2, "cache_salt": "c"}
    assert _cached(_post(server, CHAT, chat)) == 0
    assert _cached(_post(server, CHAT, chat)) > 0


def test_server_streams_cached_tokens_in_the_usage_chunk(server):
    body = {"prompt": TEXT, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_salt": "stream",
            "stream": True, "stream_options": {"include_usage": True}}
    for expect_hit in (False, True):
        with server.client.stream("POST", CMPL, json=body) as resp:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        usage = events[-1]["usage"]
        assert events[-1]["choices"] == [] and usage["completion_tokens"] == 2
        assert (usage["prompt_tokens_details"]["cached_tokens"] > 0) is expect_hit, usage


@pytest.mark.parametrize("path, body", [
    (CMPL, {"prompt": "hi", "cache_salt": 5}),
    (CMPL, {"prompt": "hi", "cache_salt": ["a"]}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "cache_salt": True}),
])
def test_server_refuses_a_non_string_salt(server, path, body):
    resp = _post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


def test_server_metrics_show_the_prefix_counters(server):
    body = {"prompt": IDS, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "cache_salt": "metrics"}
    _cached(_post(server, CMPL, body))
    assert _cached(_post(server, CMPL, body)) == 32
    m = server.metrics()
    assert m["deepinfer_prefix_cache_queries_total"] >= 2 * len(IDS)
    assert m["deepinfer_prefix_cache_hits_total"] >= 32
    assert m["deepinfer_num_cached_blocks"] > 0
    for name in ("deepinfer_prefix_cache_disk_hits_total", "deepinfer_prefix_cache_load_failures_total",
                 "deepinfer_kv_cache_dir_bytes_read_total", "deepinfer_kv_cache_dir_bytes_written_total"):
        assert name in m


def test_the_app_closes_the_engine_once_after_its_loop_stops(llm, monkeypatch):
    from fastapi.testclient import TestClient

    from deepinfer.entrypoints.openai.server import ServerSettings, build_app

    calls = []
    app = build_app(llm.engine, ServerSettings(model_name="m"))
    loop = app.state.server.engine_loop
    monkeypatch.setattr(llm.engine, "close", lambda: calls.append(loop._thread.is_alive()))
    with TestClient(app) as client:
        body = {"prompt": IDS, "max_tokens": 2, "cache_salt": "app"}
        assert _cached(client.post(CMPL, json=body)) == 0 and _cached(client.post(CMPL, json=body)) == 32
        assert calls == []
    assert calls == [False]  # once, after the engine thread ended
    loop.close_engine()
    assert calls == [False]


@pytest.mark.live_server
def test_shutdown_saves_the_cache_dir_and_a_restart_reads_it(tiny_checkpoint, tmp_path):
    """SIGTERM closes the engine, which writes the blocks the directory still lacks; a new server
    (here the app in this process) on the same directory finds the prompt's blocks there."""
    flags = ("--model", tiny_checkpoint("llama"), "--num-blocks", "64", "--kv-cache-dir", str(tmp_path))
    body = {"prompt": list(reversed(IDS)), "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "cache_salt": "restart"}
    with LiveServer(*flags) as first:
        assert _cached(_post(first, CMPL, body)) == 0
        os.kill(first.proc.pid, signal.SIGTERM)
        assert first.proc.wait(30) == 0, first.log_tail()
    files = [f for _, _, names in os.walk(tmp_path) for f in names if f.endswith(".safetensors")]
    assert len(files) >= 2, files
    with AppServer(*flags) as again:
        assert _cached(_post(again, CMPL, body)) == 32
        m = again.metrics()
    assert m["deepinfer_prefix_cache_disk_hits_total"] == 32
    assert m["deepinfer_kv_cache_dir_bytes_read_total"] > 0
