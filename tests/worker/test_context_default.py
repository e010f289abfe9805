"""max_model_len's default: the model's context where the KV cache can hold one request that long,
else the longest it can hold (one start-up line says so); `--ctx-size` names it too; it is resolved
once, before any model is built, and nothing writes it afterwards; the cache's reserved and resident
bytes."""

from __future__ import annotations

import argparse
import ast
import logging
from pathlib import Path

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine_args import EngineArgs
from deepinfer.worker.cache_engine import resident_bytes, zeroed_bytes


def test_ctx_size_is_max_model_len():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--ctx-size", "2048"])).max_model_len == 2048
    assert EngineArgs.from_cli_args(parser.parse_args(["--max-model-len", "1000"])).max_model_len == 1000
    assert EngineArgs.from_cli_args(parser.parse_args([])).max_model_len is None


def test_the_models_context_when_one_request_fits(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint("llama"), num_blocks=64, block_size=16)  # 1024 rows: the whole context
    assert llm.engine.max_model_len == 1024  # tiny_config's max_position_embeddings


def test_the_longest_request_that_fits_otherwise(tiny_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="deepinfer.worker"):
        llm = LLM(model=tiny_checkpoint("llama"), num_blocks=20, block_size=16)
    assert llm.engine.max_model_len == 320  # 20 blocks of 16 rows
    assert any("max_model_len 320: the longest request" in r.getMessage() for r in caplog.records)
    out = llm.generate([[5] * 300], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 20  # a request of exactly the fitted length runs
    with pytest.raises(ValueError, match="max_model_len 320"):
        llm.generate([[5] * 310], SamplingParams(max_tokens=20), use_tqdm=False)


def test_the_models_are_built_at_the_resolved_length(tiny_checkpoint):
    """The config the engine holds is the one the runner built its model from, and the model's RoPE
    tables end at the fitted length: nothing is lowered after the build."""
    llm = LLM(model=tiny_checkpoint("llama"), num_blocks=20, block_size=16)
    runner = llm.engine.runner
    assert llm.engine.config is runner.config and runner.config.max_model_len == 320
    assert runner.model.max_positions == 320
    assert {layer.self_attn.rotary.cos.shape[0] for layer in runner.model.model.layers} == {320}


class _Writes(ast.NodeVisitor):
    """`x.max_model_len = ...` (or setattr) in a module, except `self.max_model_len = ...` in an
    `__init__` and a CLI namespace's (`ns`) before any config exists."""

    def __init__(self, path: Path):
        self.path, self.functions, self.found = path, [], []

    def visit_FunctionDef(self, node) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    def _target(self, node, target) -> None:
        if isinstance(target, ast.Attribute) and target.attr == "max_model_len":
            owner = ast.unparse(target.value)
            in_init = owner == "self" and self.functions[-1:] == ["__init__"]
            if not in_init and owner != "ns":
                self.found.append(f"{self.path}:{node.lineno} {ast.unparse(node)[:80]}")

    def visit_Assign(self, node) -> None:
        for target in node.targets:
            self._target(node, target)

    def visit_AugAssign(self, node) -> None:
        self._target(node, node.target)

    visit_AnnAssign = visit_AugAssign

    def visit_Call(self, node) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "setattr" and any(
                isinstance(a, ast.Constant) and a.value == "max_model_len" for a in node.args):
            self.found.append(f"{self.path}:{node.lineno} setattr")
        self.generic_visit(node)


def _writes_of_max_model_len(path: Path) -> list[str]:
    writes = _Writes(path)
    writes.visit(ast.parse(path.read_text(encoding="utf-8")))
    return writes.found


def test_nothing_writes_max_model_len_after_it_is_resolved():
    package = Path(__file__).resolve().parents[2] / "deepinfer"
    assert _writes_of_max_model_len(package / "config.py") == []
    assert [w for p in sorted(package.rglob("*.py")) for w in _writes_of_max_model_len(p)] == []


def test_a_config_refuses_a_new_max_model_len():
    from deepinfer.config import EngineConfig

    for given in (None, 512):
        config = EngineConfig(max_model_len=given)
        with pytest.raises(AttributeError, match=f"max_model_len is {given!r} for this config's life"):
            config.max_model_len = 64
        resolved = config.with_max_model_len(64)
        assert resolved.max_model_len == 64 and config.max_model_len == given  # a new config, the old one as it was
        with pytest.raises(AttributeError):
            resolved.max_model_len = 32


def test_the_write_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def fit(config, n):\n    config.max_model_len = n\n    config.scheduler.max_model_len += 1\n"
                   "    setattr(config, 'max_model_len', n)\n"
                   "class A:\n    def __init__(self, n):\n        self.max_model_len = n\n")
    assert [w.split(" ", 1)[0].rsplit(":", 1)[1] for w in _writes_of_max_model_len(bad)] == ["2", "3", "4"]


@pytest.mark.multirank
def test_two_ranks_fit_the_same_length_before_they_build(tiny_checkpoint):
    """Each rank fits max_model_len before its model is built; the smallest over the ranks wins, so
    the follower builds at the length rank 0 serves, and the fitted length runs."""
    with LLM(model=tiny_checkpoint("llama"), tensor_parallel_size=2, num_blocks=20, block_size=16) as llm:
        assert llm.engine.max_model_len == 320 and llm.engine.runner.driver.model.max_positions == 320
        out = llm.generate([[5] * 300], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 20


def test_a_given_max_model_len_is_not_lowered(tiny_checkpoint):
    with pytest.raises(ValueError, match="cannot hold one request at max_model_len 1,000"):
        LLM(model=tiny_checkpoint("llama"), num_blocks=20, block_size=16, max_model_len=1000)


def test_the_weights_the_fit_counts_are_the_ones_the_build_holds(tmp_path):
    """Before the build, the fit subtracts the weights' bytes from the free memory: for a GGUF kept
    packed, only the tensors loading makes dense (the packed matrices are the file's mapped pages),
    exactly what the built model holds outside its packed matrices (the RoPE tables included: the
    fit counts them at the model's context, their largest)."""
    import gguf
    import torch
    from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf

    from deepinfer.model_executor.loader import load_model_source
    from deepinfer.model_executor.model_loader import build_meta_model
    from deepinfer.worker.context_length import weight_bytes

    config = tiny_hf_config("qwen2", intermediate_size=128)
    path = write_gguf(tmp_path / "q8.gguf", "qwen2", config, random_hf_model(config).state_dict(),
                      qtype=gguf.GGMLQuantizationType.Q8_0)
    source = load_model_source(path)
    meta = build_meta_model(source, torch.float32, 64)
    built = LLM(path, quantization="gguf", max_model_len=64, num_blocks=16).engine.runner.model
    held = sum(t.numel() * t.element_size() for t in (*built.parameters(), *built.buffers()))
    assert weight_bytes(meta, source, "gguf", torch.float32) == held
    assert weight_bytes(meta, source, "none", torch.float32) > 10 * held  # dequantized: every matrix dense


def test_resident_bytes_count_the_pages_written():
    cache = zeroed_bytes(256, 4096, "cpu")  # 1 MiB, mapped, nothing written
    assert resident_bytes(cache) == 0
    cache[:16].fill_(1)  # 16 pages
    assert resident_bytes(cache) == 16 * 4096


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2_swa", "qwen3_moe", "gemma2", "phi3", "deepseek_v3",
                                    "gpt_oss", "deepseek_v4"])
def test_the_fit_sizes_the_cache_the_build_allocates(family, tiny_checkpoint, tokenizer_dir, tmp_path):
    """The fit reads the cache groups of the model built on the meta device: for every family (its
    MTP module included where it has one) they are the groups the real build sizes, byte for byte."""
    import sys

    import torch
    from family_checkpoints import make_family_checkpoint

    from deepinfer.model_executor.loader import load_model_source
    from deepinfer.model_executor.model_loader import build_meta_model
    from deepinfer.worker.cache_runtime import plan_caches

    method = "mtp" if family in ("deepseek_v3", "deepseek_v4") else None
    if family in ("llama", "gemma3", "qwen2_swa"):
        path = tiny_checkpoint(family)
    elif family == "deepseek_v4":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models" / "deepseek_v4"))
        from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4

        path = str(tmp_path)
        make_tiny_v4(path, [SLIDING, CSA, HCA])
    else:
        path = str(tmp_path)
        make_family_checkpoint(family, path, tokenizer_dir)
    llm = LLM(model=path, load_format="dummy", max_model_len=64, num_blocks=64, block_size=4,
              speculative_method=method, num_speculative_tokens=2 if method else None)
    runner = llm.engine.runner
    meta = build_meta_model(load_model_source(path, load_format="dummy"), runner.dtype, 64, method)
    assert all(p.device == torch.device("meta") for p in meta.parameters())
    assert plan_caches(meta, None, runner.config, runner.dtype).sizing == runner.caches.sizing
