"""scripts/make_synthetic_gguf.py, the benchmarks' real-size files: a padded vocabulary reaches the
embedding, the LM head and the tokenizer; the Llama-3.1-8B shape writes an untied Q6_K head beside a
Q4_K embedding in the llama layout; the engine loads both and generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_synthetic_gguf.py"
SMALL = ["--layers", "2", "--hidden", "256", "--intermediate", "512", "--heads", "4", "--kv-heads", "2"]


def _write(path: Path, *args: str) -> gguf.GGUFReader:
    run = subprocess.run([sys.executable, str(SCRIPT), str(path), *SMALL, *args], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return gguf.GGUFReader(path)


def _tensor(reader: gguf.GGUFReader, name: str):
    return next(t for t in reader.tensors if t.name == name)


def test_padded_vocabulary_and_the_8b_layout(tmp_path):
    qwen = _write(tmp_path / "qwen.gguf", "--vocab", "60000")
    assert len(qwen.fields["tokenizer.ggml.tokens"].data) == 60000
    embd = _tensor(qwen, "token_embd.weight")
    assert embd.tensor_type == gguf.GGMLQuantizationType.Q6_K and list(embd.shape) == [256, 60000]
    assert "output.weight" not in {t.name for t in qwen.tensors}  # tied
    llama = _write(tmp_path / "llama.gguf", "--shape", "llama3.1-8b", "--vocab", "50000")
    assert bytes(llama.fields["general.architecture"].parts[-1]).decode() == "llama"
    head, embd = _tensor(llama, "output.weight"), _tensor(llama, "token_embd.weight")
    assert head.tensor_type == gguf.GGMLQuantizationType.Q6_K and embd.tensor_type == gguf.GGMLQuantizationType.Q4_K
    assert list(head.shape) == [256, 50000] and "blk.0.attn_q.bias" not in {t.name for t in llama.tensors}
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for path, vocab in ((tmp_path / "qwen.gguf", 60000), (tmp_path / "llama.gguf", 50000)):
        llm = LLM(str(path), max_model_len=64, num_blocks=16)
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert len(out) == 4 and all(0 <= t < vocab for t in out)
