"""Split GGUF sets (llama.cpp's `NAME-00001-of-0000N.gguf`, as the `gguf` package's writer makes them
for gguf-split): loaded from the first part, a quantized model answers as the same model in one file;
a later part, a missing or a foreign part, and a renamed set are refused with the file named."""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.loader.gguf_file import gguf_parts, read_gguf_file

PROMPTS = [[5, 9, 12, 40, 33, 7], [3, 4, 5, 6]]


def read_gguf_file_part(path: str) -> list:
    """The tensors stored in one part (the gguf package's reader: an independent parse)."""
    return list(gguf.GGUFReader(path).tensors)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One tiny Q8_0 Llama as a whole file and as a three-part split set (a merged q|k|v across parts)."""
    d = tmp_path_factory.mktemp("split")
    cfg = tiny_hf_config("llama", num_hidden_layers=2)
    weights = random_hf_model(cfg, seed=2).state_dict()
    whole = write_gguf(d / "whole.gguf", "llama", cfg, weights, qtype=gguf.GGMLQuantizationType.Q8_0)
    first = write_gguf(d / "model.gguf", "llama", cfg, weights, qtype=gguf.GGMLQuantizationType.Q8_0,
                       split_max_tensors=3)
    return whole, first


def test_a_split_set_loads_from_its_first_part_as_the_whole_file(files):
    whole, first = files
    parts = gguf_parts(first)
    assert len(parts) >= 3 and [os.path.basename(p) for p in parts] == [
        f"model-{i:05d}-of-{len(parts):05d}.gguf" for i in range(1, len(parts) + 1)]
    assert [t.name for t in read_gguf_file(first).tensors] == [t.name for t in read_gguf_file(whole).tensors]
    part_of = {t.name: i for i, p in enumerate(parts) for t in read_gguf_file_part(p)}
    assert any(part_of[f"blk.{i}.attn_q.weight"] != part_of[f"blk.{i}.attn_v.weight"] for i in range(2))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = []
    for path in (whole, first):
        llm = LLM(path, max_model_len=64, num_blocks=32)
        assert llm.engine.runner.quantization.value == "gguf"
        outputs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_a_later_part_names_the_first(files):
    parts = gguf_parts(files[1])
    with pytest.raises(ValueError, match=rf"part 2 of {len(parts)} of a split GGUF: load its first part, "
                                         rf"'.*model-00001-of-{len(parts):05d}\.gguf'"):
        read_gguf_file(parts[1])


def test_a_missing_or_foreign_part_is_named(files, tmp_path):
    parts = gguf_parts(files[1])
    for p in parts:
        shutil.copy(p, tmp_path / os.path.basename(p))
    local = [str(tmp_path / os.path.basename(p)) for p in parts]
    os.remove(local[2])
    with pytest.raises(ValueError, match=rf"part 3, '{local[2]}', is missing"):
        read_gguf_file(local[0])
    shutil.copy(local[1], local[2])  # part 2's bytes under part 3's name
    with pytest.raises(ValueError, match=rf"'{local[2]}' should be part 3 of {len(parts)}.*split.no is 1"):
        read_gguf_file(local[0])


def test_a_renamed_set_says_why_its_parts_cannot_be_found(files, tmp_path):
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(gguf_parts(files[1])[0], renamed)
    with pytest.raises(ValueError, match=r"part 1 of a \d+-part split GGUF, but its name does not end in "
                                         r"-00001-of-\d{5}\.gguf"):
        LLM(str(renamed), max_model_len=64, num_blocks=32)
