"""GGUF weights are views of the file's read-only shared mapping, not copies: the quantized matrices
the integer kernels read as the file lays them out lie in a `r--s` mapping of the file (by
/proc/self/maps), hold the file's bytes (read back with plain file I/O and decoded by the gguf
package), cannot be written (numpy refuses, a torch write faults), and give the same greedy tokens as
copies of them. Also: what start-up derives from a GGUF (config, tokenizer) is read back from the
cache alike, and `import deepinfer` imports neither transformers nor fastapi."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref
from deepinfer.model_executor.layers.quant_linear import packed_weights
from deepinfer.model_executor.loader import gguf_repack, load_model_source
from deepinfer.model_executor.loader.gguf_file import as_tensor, read_gguf_file

Q = gguf.GGMLQuantizationType
_PROMPTS = [[1, 5, 9, 13, 17], [1, 40, 3]]


def _write(tmp_path, arch: str, qtype) -> str:
    config = tiny_hf_config(arch, intermediate_size=128)
    state = random_hf_model(config).state_dict()
    return write_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", arch, config, state, qtype=qtype)


def _file_mappings(path: str) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of `path`."""
    real = os.path.realpath(path)
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[1]))
    return found


def _in_read_only_mapping(w: QuantWeight, path: str) -> bool:
    begin, end = w.data.data_ptr(), w.data.data_ptr() + w.nbytes
    return any(lo <= begin and end <= hi and perms == "r--s" for lo, hi, perms in _file_mappings(path))


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["Q4_0", "Q8_0"])
def test_quantized_weights_are_views_of_a_read_only_shared_mapping(tmp_path, qtype):
    path = _write(tmp_path, "qwen2", qtype)
    weights = dict(load_model_source(path).iter_weights(torch.float32, keep_quantized=True))
    packed = {name: w for name, w in weights.items() if isinstance(w, QuantWeight)}
    assert len(packed) == 2 + 2 * 7  # the embedding, the LM head, and per layer q, k, v, o, gate, up, down
    for name, w in packed.items():
        assert _in_read_only_mapping(w, path), name
    tensors = {t.name: t for t in read_gguf_file(path).tensors}
    with open(path, "rb") as f:  # the file's bytes, read without a mapping, decoded by gguf's numpy code
        raw = f.read()
    embd = tensors["token_embd.weight"]
    offset = embd.data.ctypes.data - embd.data.base.ctypes.data  # the tensor's offset in the file
    blocks = np.frombuffer(raw, np.uint8, embd.data.nbytes, offset).reshape(embd.data.shape)
    expected = gguf.quants.dequantize(blocks, qtype).reshape(embd.shape)
    assert torch.equal(dequantize_ref(packed["model.embed_tokens.weight"]), torch.from_numpy(expected))


def test_the_model_holds_the_mapping_and_matches_copied_weights(tmp_path, monkeypatch):
    """qwen3 keeps HF's row order: every matrix of the model (q|k|v and gate|up stacked as the file's
    neighbouring tensors) is a view of the mapping; copies of them give the same greedy tokens."""
    path = _write(tmp_path, "qwen3", Q.Q8_0)
    mapped = LLM(path, quantization="gguf", max_model_len=64, num_blocks=16)
    weights = packed_weights(mapped.engine.runner.model)
    assert weights and all(_in_read_only_mapping(w, path) for w in weights)
    tokens = _greedy(mapped)
    mapped.close()
    monkeypatch.setattr(gguf_repack, "as_tensor", lambda array: torch.from_numpy(np.array(array)))
    copied = LLM(path, quantization="gguf", max_model_len=64, num_blocks=16)
    assert not any(_in_read_only_mapping(w, path) for w in packed_weights(copied.engine.runner.model))
    assert _greedy(copied) == tokens
    copied.close()


def test_llama_copies_only_its_reordered_q_and_k(tmp_path):
    """llama's q/k rows go back to HF's order (a copy, and v joins their stack); o, gate|up, down and
    the embedding stay views of the mapping."""
    path = _write(tmp_path, "llama", Q.Q4_0)
    llm = LLM(path, quantization="gguf", max_model_len=64, num_blocks=16)
    modules = dict(llm.engine.runner.model.named_modules())
    for name, module in modules.items():
        for w in getattr(module, "qweights", ()):
            assert _in_read_only_mapping(w, path) == (not name.endswith("qkv_proj")), name
    llm.close()


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """One Python process (its start-up paid once): the modules `import deepinfer` and `from deepinfer
    import LLM` bring in, then a write into a mapped weight of a tiny Q8_0 file. -> (path, file digest
    before, the finished process)."""
    path = _write(tmp_path_factory.mktemp("child"), "qwen2", Q.Q8_0)
    code = textwrap.dedent(f"""
        import sys
        import deepinfer
        heavy = {{'torch', 'transformers', 'fastapi', 'uvicorn'}}
        print(sorted({{m.split('.')[0] for m in sys.modules}} & heavy), flush=True)
        from deepinfer import LLM, SamplingParams
        print(sorted({{m.split('.')[0] for m in sys.modules}} & (heavy - {{'torch'}})), flush=True)
        import torch
        from deepinfer.model_executor.loader import load_model_source
        from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight
        weights = dict(load_model_source({path!r}).iter_weights(torch.float32, keep_quantized=True))
        w = weights["model.layers.0.mlp.down_proj.weight"]
        assert isinstance(w, QuantWeight)
        print("writing", flush=True)
        w.data[0, 0] = 7
        print("written", flush=True)
    """)
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return path, digest, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_mapped_bytes_cannot_be_written(tmp_path, child):
    """numpy views refuse writes; a torch write into a mapped weight faults (SIGSEGV), the file unchanged."""
    path = _write(tmp_path, "qwen2", Q.Q8_0)
    tensor = next(t for t in read_gguf_file(path).tensors if t.name == "blk.0.ffn_down.weight")
    with pytest.raises(ValueError, match="read-only"):
        tensor.data[0, 0] = 1
    with pytest.raises(ValueError):
        tensor.data.flags.writeable = True
    assert as_tensor(tensor.data).data_ptr() == tensor.data.ctypes.data  # no copy
    path, digest, result = child
    assert result.stdout.split("\n")[2:] == ["writing", ""], result.stderr[-2000:]
    assert result.returncode == -signal.SIGSEGV
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest


@pytest.mark.subprocess
def test_import_deepinfer_imports_no_transformers_or_fastapi(child):
    assert child[2].stdout.split("\n")[:2] == ["[]", "[]"], child[2].stderr[-2000:]


def test_adjacent_weights_stack_without_a_copy_and_others_are_copied():
    storage = torch.arange(40 * 20, dtype=torch.int32).to(torch.uint8).reshape(40, 20)  # [N, row bytes] Q4_1
    a, b, c = QuantWeight(storage[:8], "Q4_1"), QuantWeight(storage[8:24], "Q4_1"), QuantWeight(storage[30:], "Q4_1")
    joined = QuantWeight.stacked([a, b])
    assert joined.data.data_ptr() == a.data.data_ptr() and torch.equal(joined.data, storage[:24])
    gap = QuantWeight.stacked([a, c])  # not neighbours: copied
    assert gap.data.data_ptr() != a.data.data_ptr() and torch.equal(gap.data, torch.cat([storage[:8], storage[30:]]))
    with pytest.raises(ValueError, match="differ"):
        QuantWeight.stacked([a, QuantWeight(torch.zeros(4, 18, dtype=torch.uint8), "Q4_0")])


def test_config_and_tokenizer_are_read_back_from_the_cache(tmp_path, monkeypatch):
    """The second load of a file takes its config and tokenizer from the cache entry the first wrote:
    the same fields, `to_dict()` and tokens; a damaged entry is rebuilt."""
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", str(tmp_path / "cache"))
    config = tiny_hf_config("llama")
    path = write_gguf(tmp_path / "tiny.gguf", "llama", config, random_hf_model(config).state_dict())
    first = load_model_source(path)
    entries = os.listdir(tmp_path / "cache" / "gguf")
    assert len(entries) == 1
    second = load_model_source(path)
    assert type(second.hf_config) is not type(first.hf_config)  # read back, not rebuilt by AutoConfig
    assert vars(second.hf_config) == vars(first.hf_config)
    assert second.hf_config.to_dict() == first.hf_config.to_dict()
    text = "<s>ab c</s>"
    assert second.tokenizer(text)["input_ids"] == first.tokenizer(text)["input_ids"]
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    assert second.tokenizer.eos_token_id == first.tokenizer.eos_token_id
    with open(tmp_path / "cache" / "gguf" / entries[0] / "derived.json", "w") as f:
        f.write("{damaged")
    third = load_model_source(path)
    assert type(third.hf_config) is type(first.hf_config)  # rebuilt, and the entry written again
    assert type(load_model_source(path).hf_config) is type(second.hf_config)
