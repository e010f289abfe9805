"""A broken GGUF stops with one line naming the file, the tensor and the sizes, before any tensor is
read: a partial download (with the command that fetches it again), an unknown or future type, a
tensor table whose tensors overlap. A model file removed or replaced while it is mapped keeps
serving (the mapping holds the old inode); only a file cut in place under a live mapping can fault,
which the loader's downloads never do (they write aside and rename)."""

from __future__ import annotations

import os
import shutil
import struct

import gguf
import pytest
import torch
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer.model_executor.loader.gguf_file import read_gguf_file


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> str:
    config = tiny_hf_config("llama")
    torch.manual_seed(0)
    return write_gguf(tmp_path_factory.mktemp("broken") / "tiny.gguf", "llama", config,
                      random_hf_model(config).state_dict(), qtype=gguf.GGMLQuantizationType.Q8_0)


def _entry_at(data: bytes, name: str) -> int:
    """Byte position of tensor `name`'s n_dims field in the tensor table."""
    key = struct.pack("<Q", len(name)) + name.encode()
    return data.index(key) + len(key)


def _patched(tmp_path, src: str, name: str, *, type_id: int | None = None, offset_delta: int = 0) -> str:
    data = bytearray(open(src, "rb").read())
    at = _entry_at(bytes(data), name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    if type_id is not None:
        struct.pack_into("<I", data, type_at, type_id)
    offset = struct.unpack_from("<Q", data, type_at + 4)[0]
    struct.pack_into("<Q", data, type_at + 4, offset + offset_delta)
    out = tmp_path / "patched.gguf"
    out.write_bytes(bytes(data))
    return str(out)


def test_a_partial_download_names_both_sizes_and_how_to_fetch_it_again(tmp_path, tiny_file):
    size = os.path.getsize(tiny_file)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(tiny_file, "rb").read()[: size * 2 // 3])
    with pytest.raises(ValueError, match=rf"cut.gguf' is {size * 2 // 3:,} bytes but its tensor table needs "
                                         rf"{size:,} \(tensor '[^']+', \w+ \[[0-9, ]+\], ends at byte {size:,}\): a "
                                         r"partial download or a cut copy; download or copy it again"):
        read_gguf_file(str(cut))
    snapshot = tmp_path / "hub" / "models--org--name-GGUF" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    shutil.copy(cut, snapshot / "name-Q8_0.gguf")
    with pytest.raises(ValueError, match=r"fetch it again with `deepinfer pull org/name-GGUF/name-Q8_0\.gguf`"):
        read_gguf_file(str(snapshot / "name-Q8_0.gguf"))


def test_an_unknown_type_names_the_tensor_the_type_and_the_gguf_version(tmp_path, tiny_file):
    path = _patched(tmp_path, tiny_file, "blk.0.ffn_up.weight", type_id=250)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has ggml type 250, which the installed gguf "
                                         r"package \([0-9.]+\) does not know \(its types end at \d+\)"):
        read_gguf_file(path)


def test_tensors_that_overlap_are_refused(tmp_path, tiny_file):
    path = _patched(tmp_path, tiny_file, "blk.0.ffn_up.weight", offset_delta=-64)
    with pytest.raises(ValueError, match=r"runs into tensor 'blk.0.ffn_up.weight' at byte [0-9,]+: its bytes do not "
                                         r"match its type and shape"):
        read_gguf_file(path)


def test_a_model_removed_or_replaced_while_loaded_keeps_answering(tmp_path, tiny_file):
    from deepinfer import LLM, SamplingParams

    path = tmp_path / "live.gguf"
    shutil.copy(tiny_file, path)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
    os.remove(path)  # `deepinfer rm`: unlinked, the mapping keeps the inode
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids == before
    (tmp_path / "new.gguf").write_bytes(b"GGUF" + bytes(100))
    os.replace(tmp_path / "new.gguf", path)  # a download renamed over it
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids == before
