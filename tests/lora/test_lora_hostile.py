"""Hostile LoRA adapters and paths (issue 38, item 4): each is a clean 400 (or a ValueError at start-up),
never a 500, and the server reads nothing it should not.

- Runtime loads (/v1/load_lora_adapter) read only from inside `--lora-dir`: a path outside it, a
  `..` walk out of it, or a symlink out of it (to another adapter, to /proc/self/mem) is refused with
  one message that does not depend on whether the target exists.
- `--lora-modules` (the operator's choice) may name any path, but the files must still be regular
  files holding bytes: /proc/self/mem behind a symlink is a ValueError, not an OSError.
- adapter_config.json: nested 5,000 deep, or a bad `alpha_pattern` / `rank_pattern` regex: a 400
  naming the file or the field; a bad config's values are not echoed back.
- GGUF: `general.alignment` 0 and a tensor of 0 dimensions: a 400.
- A 2 GB sparse weights file whose header claims 2 GB of tensors: refused with peak RSS far below
  1 GB (four loads at once, in a child process, VmHWM measured).
- /v1/models shows each adapter's name, never its path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from lora_adapters import make_adapter

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
import app_server  # noqa: E402

SECRET = "SECRET-4f1c contents of some other file"
OUTSIDE = "outside the directories this server loads adapters from"


@pytest.fixture(scope="module")
def hostile(tiny_checkpoint, tmp_path_factory):
    """(server, allowed dir, outside dir, a good adapter inside allowed, one outside)."""
    from deepinfer.entrypoints.openai.args import lora_settings

    base = tiny_checkpoint("llama")
    allowed, outside = tmp_path_factory.mktemp("allowed"), tmp_path_factory.mktemp("outside")
    good = make_adapter(base, str(allowed / "good"), r=4, targets=["q_proj", "v_proj"], seed=5)
    elsewhere = str(outside / "elsewhere")
    shutil.copytree(good, elsewhere)
    flags = ["--model", base, "--dtype", "float32", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16",
             "--lora-modules", f"op={elsewhere}", "--allow-runtime-lora-updating", "--lora-dir", str(allowed),
             "--max-model-len", "64", "--num-blocks", "16", "--block-size", "8"]
    plain = app_server.server_settings
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(app_server, "server_settings", lambda args: dataclasses.replace(plain(args), **lora_settings(args)))
        with app_server.AppServer(*flags) as server:
            yield server, allowed, outside, good, elsewhere


def _load(server, name: str, path) -> tuple[int, str]:
    response = server.client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    message = response.json()["error"]["message"] if response.status_code != 200 else ""
    return response.status_code, message


def _variant(good: str, directory: Path, config: dict | str | bytes | None = None) -> Path:
    """A copy of the good adapter at `directory`, its adapter_config.json replaced by `config` (a dict is
    merged into the good one; text or bytes are written as they are)."""
    shutil.copytree(good, directory)
    file = directory / "adapter_config.json"
    if isinstance(config, dict):
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    elif isinstance(config, str):
        file.write_text(config)
    elif isinstance(config, bytes):
        file.write_bytes(config)
    return directory


def test_a_config_nested_5000_deep_is_a_400(hostile):
    server, allowed, _, good, _ = hostile
    nested = '{"peft_type": "LORA", "extra": ' + "[" * 5000 + "]" * 5000 + "}"
    status, message = _load(server, "nested", _variant(good, allowed / "nested", nested))
    assert status == 400, message
    assert "adapter_config.json nests arrays and objects deeper than" in message


@pytest.mark.parametrize("field", ["alpha_pattern", "rank_pattern"])
def test_a_bad_pattern_regex_is_a_400_naming_the_field(hostile, field):
    server, allowed, _, good, _ = hostile
    status, message = _load(server, f"bad-{field}", _variant(good, allowed / f"bad-{field}", {field: {"q_proj(": 8}}))
    assert status == 400, message
    assert f"{field} key" in message and "not a valid regular expression" in message


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def write_gguf(path: Path, alignment: int | None = None, dims: tuple[int, ...] = (8, 4)) -> Path:
    """A one-tensor llama GGUF LoRA file, written field by field (the gguf package's writer refuses
    what this test needs): optional general.alignment (uint32), one F32 tensor of `dims`."""
    kv = [("general.architecture", 8, _gguf_string("llama")), ("general.type", 8, _gguf_string("adapter")),
          ("adapter.type", 8, _gguf_string("lora")), ("adapter.lora.alpha", 6, struct.pack("<f", 8.0))]
    if alignment is not None:
        kv.append(("general.alignment", 4, struct.pack("<I", alignment)))
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv))
    head += b"".join(_gguf_string(key) + struct.pack("<I", kind) + value for key, kind, value in kv)
    head += _gguf_string("blk.0.attn_v.weight.lora_a") + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
    head += struct.pack("<IQ", 0, 0)  # F32, offset 0
    head += b"\0" * (-len(head) % 32)
    count = 1
    for d in dims:
        count *= d
    path.write_bytes(head + b"\0" * (4 * count))
    return path


def test_the_gguf_builder_writes_a_readable_file(tmp_path):
    from deepinfer.model_executor.loader.gguf_file import read_gguf_file

    file = read_gguf_file(str(write_gguf(tmp_path / "ok.gguf", alignment=32)))
    assert file.metadata["adapter.type"] == "lora" and file.tensors[0].shape == (4, 8)


@pytest.mark.parametrize("case", ["alignment-0", "0-dim-tensor"])
def test_hostile_gguf_headers_are_400s(hostile, case):
    server, allowed, _, _, _ = hostile
    if case == "alignment-0":
        path = write_gguf(allowed / f"{case}.gguf", alignment=0)
        expected = "general.alignment must be a positive integer"
    else:
        path = write_gguf(allowed / f"{case}.gguf", dims=())
        expected = "has 0 dimensions"
    status, message = _load(server, case, path)
    assert status == 400, message
    assert "not a readable GGUF LoRA file" in message and expected in message


@pytest.mark.parametrize("file", ["adapter_config.json", "adapter_model.safetensors"])
def test_proc_self_mem_behind_a_symlink_is_refused(hostile, file):
    """At run time: a link out of --lora-dir, refused without naming its target. From the operator
    (--lora-modules): a ValueError (the file holds no bytes), never an OSError from reading it."""
    server, allowed, outside, good, _ = hostile
    for root in (allowed, outside):
        directory = _variant(good, root / f"mem-{file}")
        (directory / file).unlink()
        (directory / file).symlink_to("/proc/self/mem")
    status, message = _load(server, f"mem-{file}", allowed / f"mem-{file}")
    assert status == 400, message
    assert OUTSIDE in message and "/proc" not in message
    adapters = server.app.state.server.adapters
    with pytest.raises(ValueError, match=f"{file} holds 0 bytes"):
        adapters.add(f"op-mem-{file}", str(outside / f"mem-{file}"))


def test_a_path_outside_lora_dir_is_refused_without_saying_whether_it_exists(hostile):
    server, allowed, outside, _, elsewhere = hostile
    (allowed / "link-out").symlink_to(elsewhere)
    tries = {"existing": elsewhere, "missing": outside / "no-such-adapter", "dotdot": allowed / ".." / outside.name
             / "elsewhere", "symlink": allowed / "link-out", "system": "/etc", "gguf": "/etc/passwd.gguf"}
    messages = {}
    for case, path in tries.items():
        status, message = _load(server, "x", path)
        assert status == 400, (case, message)
        messages[case] = message
    assert len(set(messages.values())) == 1, messages  # one message whatever the target
    assert OUTSIDE in messages["existing"] and str(outside) not in messages["existing"]
    assert "x" not in [m["id"] for m in server.client.get("/v1/models").json()["data"]]


@pytest.mark.parametrize("case", ["peft_type", "lora_alpha", "target_modules", "not-json", "not-utf8"])
def test_the_error_for_a_bad_config_does_not_echo_its_contents(hostile, case):
    server, allowed, _, good, _ = hostile
    config = {"peft_type": {"peft_type": SECRET}, "lora_alpha": {"lora_alpha": SECRET},
              "target_modules": {"target_modules": [SECRET, "q_proj"]}, "not-json": f"{SECRET}\n",
              "not-utf8": SECRET.encode() + b"\xff\xfe"}[case]
    status, message = _load(server, f"echo-{case}", _variant(good, allowed / f"echo-{case}", config))
    assert status == 400, message
    assert "SECRET" not in message and "4f1c" not in message
    assert f"echo-{case}" in message


def test_models_show_adapter_names_not_paths(hostile):
    server, allowed, _, good, elsewhere = hostile
    assert _load(server, "listed", good) == (200, "")
    cards = [m for m in server.client.get("/v1/models").json()["data"] if m.get("parent")]
    assert {m["id"] for m in cards} >= {"op", "listed"}
    for card in cards:
        text = json.dumps(card)
        assert card["root"] == card["id"]
        assert str(allowed) not in text and elsewhere not in text and "/" not in card["root"]
    assert server.client.post("/v1/unload_lora_adapter", json={"lora_name": "listed"}).status_code == 200


def test_the_identity_is_of_the_bytes_read(hostile):
    from deepinfer.model_executor.loader.lora import adapter_files, adapter_fingerprint, read_adapter

    _, _, _, good, _ = hostile
    config, tensors, identity = read_adapter(good, "good")
    assert identity == adapter_fingerprint(adapter_files(good, "good"))
    assert config["r"] == 4 and all(t.shape[0] == 4 or t.shape[1] == 4 for t in tensors.values())


_SPARSE_CHILD = textwrap.dedent("""
    import json, sys, threading
    from deepinfer.contracts.lora import LoRABase, LoRARequest
    from deepinfer.model_executor.loader.lora import AdapterChecker

    def hwm_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    base = LoRABase({f"model.layers.{i}.self_attn.{m}": (64, 64) for i in range(2) for m in ("q_proj", "v_proj")},
                    16, "tag", {})
    checker, errors = AdapterChecker(base), []
    before = hwm_kb()

    def load(i):
        try:
            checker.resolve(LoRARequest(f"sparse-{i}", i + 1, sys.argv[1]))
            errors.append("loaded")
        except ValueError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps({"delta_kb": hwm_kb() - before, "errors": errors}))
""")


@pytest.mark.subprocess
def test_a_2gb_sparse_adapter_is_refused_with_small_peak_rss(tmp_path):
    """Four concurrent loads of a weights file whose header claims 2 GiB of float32 tensors (a sparse
    file that really is 2 GiB long): each refused before its tensors are read, VmHWM grows < 1 GB."""
    directory = tmp_path / "sparse"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 16}))
    cols = (2 << 30) // 4 // 16
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                         {"dtype": "F32", "shape": [16, cols], "data_offsets": [0, 2 << 30]}}).encode()
    with open(directory / "adapter_model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + (2 << 30))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _SPARSE_CHILD, str(directory)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth over four concurrent loads: {result['delta_kb'] / 1024:.1f} MiB")
    assert len(result["errors"]) == 4 and all("adapter_model.safetensors holds" in e for e in result["errors"])
    assert result["delta_kb"] < 1 << 20  # KiB: 1 GiB


def test_a_header_claiming_more_than_the_file_holds_is_refused_before_reading(tmp_path):
    from deepinfer.model_executor.loader.lora_files import read_safetensors

    path = tmp_path / "adapter_model.safetensors"
    header = json.dumps({"t": {"dtype": "F32", "shape": [1 << 20, 1 << 10], "data_offsets": [0, 1 << 32]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(ValueError, match="its tensors cover 4294967296 bytes; the file holds 64"):
        read_safetensors(str(path), "adapter 'x'", None, lambda name: None)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header claims 1099511627776 bytes"):
        read_safetensors(str(path), "adapter 'x'", None, lambda name: None)


def test_lora_dir_must_be_a_directory_and_needs_runtime_loading(tmp_path):
    from deepinfer.entrypoints.openai.args import lora_settings

    with pytest.raises(ValueError, match="--lora-dir .*nowhere.* is not a directory"):
        lora_settings(app_server.serve_args(["--allow-runtime-lora-updating", "--lora-dir", str(tmp_path / "nowhere")]))
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating"):
        lora_settings(app_server.serve_args(["--lora-dir", str(tmp_path)]))
    settings = lora_settings(app_server.serve_args(["--allow-runtime-lora-updating", "--lora-dir", str(tmp_path)]))
    assert settings["lora_dirs"] == (str(tmp_path),)
