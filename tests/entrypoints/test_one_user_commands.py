"""What the one-user commands and `deepinfer serve` print about themselves: `generate` and `chat`
size the KV cache for one request (no warning about a server's 64-request batch they never run), the
weight-loading bar never shows a count it has not reached, and the server names its chat page and
dashboard once it listens."""

from __future__ import annotations

import asyncio
import io
import logging

from deepinfer import LLM
from deepinfer.entrypoints import cli
from deepinfer.worker import cache_sizing

SMALL_MEMORY = 8 << 20  # bytes "free": one tiny-llama request at max_model_len fits, 64 of them do not


def _cache_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache auto")]


def test_generate_and_chat_size_the_cache_for_one_request(tiny_checkpoint, monkeypatch, caplog, capsys):
    parser = cli.build_parser()
    counts = [parser.parse_args([*argv, "--model", "m"]).max_num_seqs
              for argv in (["generate", "x"], ["chat"], ["run", "m"], ["serve"],
                           ["generate", "x", "--max-num-seqs", "3"])]
    assert counts == [1, 1, 1, 64, 3]
    monkeypatch.setattr(cache_sizing, "available_memory", lambda device: SMALL_MEMORY)
    caplog.set_level(logging.INFO, logger="deepinfer")
    model = tiny_checkpoint("llama")
    assert cli.main(["generate", "hi", "--model", model, "--raw", "--max-tokens", "2", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip()
    lines = _cache_lines(caplog)
    assert len(lines) == 1 and "for 1 requests at max_model_len" in lines[0] and "would take" not in lines[0], lines
    caplog.clear()
    with LLM(model):  # a server's batch, in the same memory: the warning is the batch's
        assert any("64 requests at max_model_len would take" in line for line in _cache_lines(caplog))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_loading_bar_never_draws_a_count_it_has_not_reached(monkeypatch):
    """A GGUF whose matrices stay packed hands over its tensors within milliseconds: the bar drew only
    its first frame, "0 tensors". Now it is drawn only when loading lasts (here a clock that jumps
    a second per reading), and then with the count reached."""
    import tqdm.std

    from deepinfer.model_executor import model_loader

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert list(model_loader.weight_progress(iter(range(300)))) == list(range(300))
    assert terminal.getvalue() == ""  # fast: nothing drawn
    clock = iter(float(t) for t in range(10_000))
    monkeypatch.setattr(tqdm.std, "time", lambda: next(clock))
    assert list(model_loader.weight_progress(iter(range(300)))) == list(range(300))
    frames = [frame for frame in terminal.getvalue().split("\r") if "loading weights" in frame]
    assert frames and all(" 0 tensors" not in frame for frame in frames), frames


def test_serve_names_its_pages_once_it_listens(capsys):
    import uvicorn

    from deepinfer.entrypoints.openai.launcher import GracefulServer

    async def app(scope, receive, send):  # lifespan only: no request comes
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})

    server = GracefulServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"), None, 1.0)

    async def start_and_stop() -> int:
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        server.should_exit = True
        await serving
        return port

    port = asyncio.run(asyncio.wait_for(start_and_stop(), 60))  # a bound: it must not hang
    base = f"http://127.0.0.1:{port}"
    out = capsys.readouterr().out
    assert f"chat page {base}/" in out and f"dashboard {base}/dashboard" in out, out
    assert out.count(base) == 2
