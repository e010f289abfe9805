"""A local HTTP server standing in for the Hugging Face Hub (`deepinfer pull / list / rm` tests).

It answers exactly what huggingface_hub asks: model info with file metadata
(GET /api/models/{repo}/revision/{rev}?blobs=True), paths-info (POST .../paths-info/{rev}), and
HEAD / GET of /{repo}/resolve/{rev}/{file} with X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size
and Range support. It can also answer like a hostile or spoofed endpoint (`FakeHub`'s fault
fields): other headers, other names in a listing, a redirect to another origin.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import re
import threading
import urllib.parse

CKPT_REPO, GGUF_REPO = "tiny-org/tiny-llama", "tiny-org/tiny-gguf"
CKPT_COMMIT, GGUF_COMMIT = "c" * 40, "d" * 40
GGUF_FILE = "tiny.Q8_0.gguf"
SPLIT_REPO, SPLIT_COMMIT = "tiny-org/split-gguf", "e" * 40  # a Q4_K_M split set, a Q8_0 file, a projector
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
        SPLIT_REPO: (SPLIT_COMMIT, {f"Q4_K_M/m-Q4_K_M-0000{i}-of-00002.gguf": gguf[1000 * i:1000 * i + 900]
                                    for i in (1, 2)} | {"m-Q8_0.gguf": gguf[:700], "mmproj-m-F16.gguf": gguf[:300]}),
    }


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs(path: str, data: bytes) -> dict | None:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} if path.endswith(LFS_SUFFIXES) else None


class FakeHub:
    """The repositories, what the server saw, and the faults it injects."""

    def __init__(self):
        self.repos = _repos()
        self.url = ""  # http://127.0.0.1:PORT, set when it serves
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.authorization: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self.corrupt: set[str] = set()  # files served with other bytes than their listed sha256
        self.cut_after: dict[str, int] = {}  # file -> bytes sent before the first GET's connection drops
        self.refuse_gets = False  # after a cut: answer GETs with 503 (the download cannot finish)
        # a hostile or spoofed endpoint:
        self.headers: dict[str, str | None] = {}  # replace, add (or drop: None) headers of /resolve answers
        self.info_sha: str | None = None  # the model info's "sha" instead of the commit
        self.extra_siblings: list[dict] = []  # more entries in the model info's file listing
        self.paths_info_path: str | None = None  # paths-info names this path instead of the one asked for
        self.redirect_to: str | None = None  # /resolve answers 302 to this base URL (+ /repo/file)

    def gets(self, filename: str) -> list[str | None]:
        """The Range headers of the GETs of `filename`, in order."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + filename)]


def _file_of(hub: FakeHub, repo_id: str, rev_and_file: str) -> str:
    """The repository file that `{rev}/{file}` ends with (a revision may hold slashes: the server
    answers whatever it is asked, as a hostile one would)."""
    files = hub.repos[repo_id][1] if repo_id in hub.repos else {}
    return max((f for f in files if rev_and_file.endswith("/" + f)), key=len, default=rev_and_file)


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
            hub.authorization.append((method, path, self.headers.get("Authorization")))
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/(.+)", path):
                return self._model_info(m[1])
            if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/(.+)", path):
                return self._paths_info(m[1])
            if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/(.+)", path):  # any revision: {rev}/{file}
                return self._resolve(method, m[1], _file_of(hub, m[1], m[2]))
            if m := re.fullmatch(r"/cdn/([^/]+/[^/]+)/(.+)", path):  # where a redirect points
                return self._resolve(method, m[1], m[2], cdn=True)
            self._json(404, {"error": f"no route {path}"})

        def _model_info(self, repo_id: str) -> None:
            if (repo := self._repo(repo_id)) is None:
                return
            commit, files = repo
            siblings = [{"rfilename": p, "size": len(d), "blobId": blob_id(d),
                         **({"lfs": {**lfs, "pointerSize": 134}} if (lfs := _lfs(p, d)) else {})}
                        for p, d in files.items()]
            self._json(200, {"id": repo_id, "sha": hub.info_sha or commit, "siblings": siblings + hub.extra_siblings})

        def _paths_info(self, repo_id: str) -> None:
            form = urllib.parse.parse_qs(self.rfile.read(int(self.headers["Content-Length"])).decode())
            if (repo := self._repo(repo_id)) is None:
                return
            entries = []
            for p in form.get("paths", []):
                if (d := repo[1].get(p)) is not None:
                    lfs = _lfs(p, d)
                    entries.append({"type": "file", "path": hub.paths_info_path or p, "size": len(d),
                                    "oid": blob_id(d),
                                    **({"lfs": {"oid": lfs["sha256"], "size": len(d), "pointerSize": 134}}
                                       if lfs else {})})
            self._json(200, entries)

        def _resolve(self, method: str, repo_id: str, filename: str, cdn: bool = False) -> None:
            if (repo := self._repo(repo_id)) is None:
                return
            commit, files = repo
            if filename not in files:
                return self._json(404, {"error": "Entry not found"}, [("X-Error-Code", "EntryNotFound")])
            data, lfs = files[filename], _lfs(filename, files[filename])
            headers = {"X-Repo-Commit": commit, "ETag": f'"{blob_id(data)}"', "Accept-Ranges": "bytes"}
            if lfs:
                headers.update({"X-Linked-Etag": f'"{lfs["sha256"]}"', "X-Linked-Size": str(len(data))})
            headers = [(k, v) for k, v in {**headers, **hub.headers}.items() if v is not None]
            if hub.redirect_to and not cdn:
                location = f"{hub.redirect_to}/cdn/{repo_id}/{filename}"
                return self._send(302, headers + [("Location", location), ("Content-Length", "0")], b"")
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


@contextlib.contextmanager
def serve_fake_hub(tmp_path, monkeypatch):
    """A fake Hub on a local port; HF_ENDPOINT, HF_HUB_CACHE and DEEPINFER_MODELS_DIR point at it / tmp."""
    fake = FakeHub()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("DEEPINFER_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.chdir(tmp_path)  # no local path called tiny-org/... exists
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
