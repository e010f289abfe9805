"""max_model_len's default: the model's context where the KV cache can hold one request that long,
else the longest it can hold (one start-up line says so); `--ctx-size` names it too; the cache's
reserved and resident bytes."""

from __future__ import annotations

import argparse
import logging

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


def test_a_given_max_model_len_is_not_lowered(tiny_checkpoint):
    with pytest.raises(ValueError, match="cannot hold one request at max_model_len 1,000"):
        LLM(model=tiny_checkpoint("llama"), num_blocks=20, block_size=16, max_model_len=1000)


def test_resident_bytes_count_the_pages_written():
    cache = zeroed_bytes(256, 4096, "cpu")  # 1 MiB, mapped, nothing written
    assert resident_bytes(cache) == 0
    cache[:16].fill_(1)  # 16 pages
    assert resident_bytes(cache) == 16 * 4096
