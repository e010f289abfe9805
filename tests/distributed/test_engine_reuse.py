"""Engines are reusable in one process: an LLM released by close(), by the end of its `with` block
or by `del llm` and garbage collection stops its worker processes and destroys its process group,
so the next LLM (one rank or several) starts and generates the same tokens. A closed LLM refuses
use; closing twice is harmless; a second multi-rank LLM while one is open is refused before any
worker starts, and the open one keeps working."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from deepinfer import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from tp_processes import still_alive, workers  # noqa: E402

pytestmark = [pytest.mark.multirank]

SMALL = dict(max_model_len=48, num_blocks=16, block_size=4)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 11)]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _generate_and_release(model: str, how: str, tensor_parallel_size: int = 2) -> tuple[list, list[int]]:
    """Build an LLM, generate, release it `how` ("close", "with" or "del"); its tokens and the
    worker processes it had."""
    if how == "with":
        with LLM(model, tensor_parallel_size=tensor_parallel_size, **SMALL) as llm:
            return _tokens(llm), workers(os.getpid())
    llm = LLM(model, tensor_parallel_size=tensor_parallel_size, **SMALL)
    tokens, pids = _tokens(llm), workers(os.getpid())
    if how == "close":
        llm.close()
        llm.close()  # idempotent
    else:
        del llm
        gc.collect()
    return tokens, pids


def _assert_released(pids: list[int]) -> None:
    """No worker process left (the release waited for them), no process group, no watchdog."""
    assert still_alive(pids) == []
    assert workers(os.getpid()) == []
    assert not dist.is_initialized()
    assert not [t for t in threading.enumerate() if t.name == "deepinfer-tp-watchdog"]


@pytest.mark.parametrize("how", ["del", "close", "with"])
def test_a_released_two_rank_llm_frees_its_ranks_and_the_next_one_generates_the_same(llama, how):
    first, first_pids = _generate_and_release(llama, how)
    assert len(first_pids) == 1  # it did run a worker
    _assert_released(first_pids)
    second, second_pids = _generate_and_release(llama, how)
    assert len(second_pids) == 1 and second_pids != first_pids
    _assert_released(second_pids)
    assert second == first


def test_one_rank_then_two_ranks_then_one_rank_in_one_process(llama):
    one, _ = _generate_and_release(llama, "close", tensor_parallel_size=1)
    two, pids = _generate_and_release(llama, "del")
    _assert_released(pids)
    again, _ = _generate_and_release(llama, "with", tensor_parallel_size=1)
    assert two == one and again == one


def test_a_second_open_two_rank_llm_is_refused_and_the_first_keeps_working(llama):
    with LLM(llama, tensor_parallel_size=2, **SMALL) as llm:
        before = _tokens(llm)
        pids = workers(os.getpid())
        with pytest.raises(RuntimeError, match="another engine with tensor_parallel_size > 1 open.*Close it first"):
            LLM(llama, tensor_parallel_size=2, **SMALL)
        assert workers(os.getpid()) == pids  # refused before any worker started
        assert _tokens(llm) == before
    _assert_released(pids)


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_closed_llm_refuses_use(llama, tensor_parallel_size):
    llm = LLM(llama, tensor_parallel_size=tensor_parallel_size, **SMALL)
    llm.close()
    for use in (lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False), llm.get_metrics,
                lambda: next(llm.stream(PROMPTS[0], GREEDY))):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            use()
    llm.close()  # still harmless


@pytest.mark.parametrize("how", ["close", "with", "del"])
def test_releasing_a_one_rank_llm_frees_its_kv_cache(llama, how):
    llm = LLM(llama, **SMALL)
    _tokens(llm)
    cache = weakref.ref(llm.engine.runner.caches.cache)
    if how == "close":
        llm.close()
    elif how == "with":
        with llm:
            pass
    else:
        del llm
    gc.collect()
    assert cache() is None


def test_a_dropped_llm_saves_its_kv_cache_directory(llama, tmp_path):
    """Dropped without close(), an LLM with a cache directory still writes it when collected."""
    cache_dir = tmp_path / "kv"
    llm = LLM(llama, kv_cache_dir=str(cache_dir), **SMALL)
    _tokens(llm)
    saved = len(list(cache_dir.rglob("*.safetensors")))  # the last step's blocks wait for close
    del llm
    gc.collect()
    assert len(list(cache_dir.rglob("*.safetensors"))) > saved
