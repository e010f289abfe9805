"""The saved cache directory (`kv_cache_dir`) with two tensor-parallel ranks: each rank saves its
slice of every cached unit under a root folder of its own; a later engine with two ranks reads
them back (hits on its first request) and gives the tokens of caching off. A slice file missing on
one rank fails that request's load on both ranks alike: recomputed, same tokens, no hang."""

from __future__ import annotations

import os
import random

import pytest

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.multirank]

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
KW = dict(max_num_batched_tokens=128, max_model_len=256, prefix_snapshot_interval=32, num_blocks=32)


def _prompts() -> list[list[int]]:
    """A 90-token prefix (past two snapshot intervals) with two tails."""
    rng = random.Random(4)
    base = [rng.randrange(3, 49152) for _ in range(90)]
    return [base + [rng.randrange(3, 49152) for _ in range(n)] for n in (7, 12)]


def _run(path: str, **kw) -> tuple[list, dict, str]:
    """The prompts one at a time: outputs, metrics, and the engine's cache identity (rank 0's)."""
    with LLM(path, **KW, **kw) as llm:
        outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in _prompts()]
        llm.engine.kv_manager.check_no_leaks()
        return outs, llm.get_metrics(), llm.engine.runner.cache_identity


def _files(directory: str) -> dict[str, set[str]]:
    """Root folder -> the unit files in it."""
    return {root: set(os.listdir(os.path.join(directory, root))) - {".lock"} for root in os.listdir(directory)
            if os.path.isdir(os.path.join(directory, root))}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_two_ranks_save_their_slices_and_read_them_back(arch, tiny_checkpoint, tmp_path):
    path, cache_dir = tiny_checkpoint(arch), str(tmp_path / "kv")
    want = [o.outputs[0].token_ids for o in _run(path, enable_prefix_caching=False)[0]]

    first, _, identity = _run(path, tensor_parallel_size=2, kv_cache_dir=cache_dir)
    assert [o.outputs[0].token_ids for o in first] == want
    roots = _files(cache_dir)
    assert len(roots) == 2, roots  # rank 0's folder and rank 1's
    names = list(roots.values())
    assert names[0] == names[1] and any(n.endswith(".safetensors") for n in names[0])  # every unit on both
    if arch == "gemma3":
        assert any(n.endswith(".snapshot.safetensors") for n in names[0]), "ring models save snapshots"

    second, metrics, _ = _run(path, tensor_parallel_size=2, kv_cache_dir=cache_dir)
    assert [o.outputs[0].token_ids for o in second] == want
    assert second[0].num_cached_tokens >= 64  # the first request of a new engine hits the directory
    assert metrics["prefix_cache_disk_hits"] > 0 and metrics["prefix_cache_load_failures"] == 0

    assert identity[:16] in roots  # rank 0 saves under the engine's root
    follower_root = next(root for root in roots if root != identity[:16])
    for name in roots[follower_root]:
        os.remove(os.path.join(cache_dir, follower_root, name))  # rank 1's slices gone, rank 0's kept
    third, metrics, _ = _run(path, tensor_parallel_size=2, kv_cache_dir=cache_dir)
    assert [o.outputs[0].token_ids for o in third] == want
    assert metrics["prefix_cache_load_failures"] > 0  # both ranks dropped the hit and recomputed

