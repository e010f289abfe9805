"""Tiny Llama, Qwen3 (one KV head: replicated over the ranks) and Gemma 3 (ring layers, tied head)
split over 2 gloo ranks give the logits of one rank and of HF transformers under teacher forcing.

Each rank builds the model after joining the group (as the multi-process executor does), runs a
chunked prefill and three decode steps through its own cache, and gathers full logits [T, V].
Tolerance (fp32): 1e-4 absolute and relative against one rank (the ranks' sums add in another
order); 1e-3 on log-probabilities against HF, as the single-rank parity tests use.
"""

from __future__ import annotations

import random

import pytest
import torch
from gemma2_phi3_models import gemma2_phi3_checkpoint  # noqa: F401  (a fixture)
from slice_reads import spy_slice_reads
from test_parallel_layers import run_ranks
from tiny_models import hf_reference, run_steps

from deepinfer import LLM
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers import parallel_linear

pytestmark = [pytest.mark.multirank]

ARCHS = {"llama": {}, "qwen3": {"num_key_value_heads": 1}, "gemma3": {}}
OTHER_ARCHS = ("gemma2", "phi3_swa")  # tests/gemma2_phi3_models.py; phi3: fused qkv_proj / gate_up_proj
PREFILL, CHUNK, DECODE = 30, 17, 3  # Gemma 3's window is 16: its rings wrap
TOKENS = [random.Random(7).randrange(3, 49152) for _ in range(PREFILL + DECODE)]


def _steps(llm: LLM) -> list[ScheduledRequest]:
    """Prefill in two chunks, then one token per step (teacher forcing), in blocks 0.. and ring slot 0."""
    groups = llm.engine.runner.groups
    tables = tuple(list(range(8)) for g in groups if not g.is_ring)
    states = tuple(0 for g in groups if g.is_ring)
    cuts = [0, CHUNK, PREFILL] + list(range(PREFILL + 1, PREFILL + DECODE + 1))
    return [ScheduledRequest("r", TOKENS[a:b], a, tables, states) for a, b in zip(cuts, cuts[1:], strict=False)]


def model_logits(path: str, load_format: str = "auto") -> torch.Tensor:
    """Logits [PREFILL + DECODE, V] of every position, in this process's rank setting."""
    llm = LLM(path, dtype="float32", num_blocks=16, block_size=8, max_model_len=128, max_num_seqs=2,
              enable_prefix_caching=False, load_format=load_format)
    return torch.cat(run_steps(llm, _steps(llm)))  # [L, V]


def _rank_logits(rank: int, path: str, out_dir: str) -> None:
    reads = spy_slice_reads()["read"]
    calls = _count_all_reduces()
    llm = LLM(path, dtype="float32", num_blocks=16, block_size=8, max_model_len=128, max_num_seqs=2,
              enable_prefix_caching=False)
    _check_rank_cache(llm)
    steps = _steps(llm)
    calls.clear()
    logits = torch.cat(run_steps(llm, steps))  # [L, V]
    layers = llm.engine.runner.model.config.num_hidden_layers
    assert len(calls) == len(steps) * (2 * layers + 1), len(calls)  # per layer: attention + MLP; + the embedding
    assert not [n for n in reads if "proj" in n or "embed" in n or "lm_head" in n], reads  # split tensors: slices only
    torch.save({"ckpt": logits, "dummy": model_logits(path, "dummy")}, f"{out_dir}/rank{rank}.pt")


def _check_rank_cache(llm: LLM) -> None:
    """Each rank's cache rows hold its own KV heads only."""
    cfg = llm.engine.runner.model.config
    local = max(1, cfg.num_key_value_heads // 2)
    assert {g.row.num_kv_heads for g in llm.engine.runner.groups} == {local}


def _count_all_reduces() -> list[int]:
    calls: list[int] = []
    inner = parallel_linear.all_reduce

    def counted(x):
        calls.append(1)
        return inner(x)

    parallel_linear.all_reduce = counted
    return calls


@pytest.mark.parametrize("arch", list(ARCHS) + list(OTHER_ARCHS))
def test_two_ranks_equal_one_rank_and_hf(arch, tiny_checkpoint, gemma2_phi3_checkpoint, tmp_path):  # noqa: F811
    path = gemma2_phi3_checkpoint(arch) if arch in OTHER_ARCHS else tiny_checkpoint(arch, **ARCHS[arch])
    run_ranks(_rank_logits, tmp_path, path, str(tmp_path))
    one = model_logits(path)  # [L, V]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:  # every rank holds the full logits
        torch.testing.assert_close(got["ckpt"], one, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got["dummy"], model_logits(path, "dummy"), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ref = hf_reference(path)(input_ids=torch.tensor([TOKENS]), use_cache=False).logits[0].float()  # [L, V]
    torch.testing.assert_close(torch.log_softmax(ranks[0]["ckpt"], -1), torch.log_softmax(ref, -1), atol=1e-3, rtol=0)
    assert torch.equal(ranks[0]["ckpt"].argmax(-1), ref.argmax(-1))


def test_bad_sizes_are_refused_naming_them(tiny_checkpoint):
    from tiny_models import tiny_config

    from deepinfer.model_executor.models.llama import check_tensor_parallel

    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        check_tensor_parallel(tiny_config("llama"), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide intermediate_size=127"):
        check_tensor_parallel(tiny_config("llama", intermediate_size=127), 2)


@pytest.fixture
def as_rank_of(monkeypatch):
    """as_rank_of(n): this process reads tp_size() == n (no group joined: model construction and the
    start-up checks run no collective)."""
    from deepinfer.distributed import parallel_state

    return lambda n: monkeypatch.setitem(parallel_state._WORLD, "size", n)


def _dummy_source(path: str):
    from deepinfer.model_executor.loader.source import load_model_source

    return load_model_source(path, load_format="dummy")


def test_build_refuses_a_split_the_heads_do_not_take(tiny_checkpoint, as_rank_of):
    from deepinfer.model_executor.model_loader import build_model

    as_rank_of(3)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        build_model(_dummy_source(tiny_checkpoint("llama")), torch.float32, torch.device("cpu"), 64)
