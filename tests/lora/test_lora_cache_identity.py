"""A cached KV row is reused only for the same adapter content (seed 004: never after a change of
weights, adapter, positions or earlier tokens).

A request's prefix chain starts from a root that includes its adapter's content key: requests with
different adapters never share a block; two names (and paths) for the same adapter files do; an
adapter rewritten at the same path is new content and hits nothing computed with the old one; and
the saved cache directory keeps these units apart across a restart, so a second engine finds the
same hits and misses. Every hit's tokens are checked against PEFT with the right adapter.
"""

from __future__ import annotations

import shutil

import pytest
from lora_adapters import ADAPTER_SPECS, PeftReference, assert_matches_reference, make_adapter, make_adapters

from deepinfer import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.slow]

PROMPT = list(range(100, 140))  # 40 tokens: with 8-token blocks a hit covers 32 of them
HIT = 32
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
ENGINE = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=8, max_model_len=64,
              num_blocks=64)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = make_adapters(base, root)
    copy = str(root / "a-copy")
    shutil.copytree(adapters["a"], copy)  # the same bytes under another directory
    return base, adapters, copy, PeftReference(base, adapters)


class Session:
    """One engine; `run(name, path)` generates PROMPT with that adapter (None: the base) and returns
    how many prompt tokens came from the cache, after checking the tokens against `reference`."""

    def __init__(self, base: str, **kwargs):
        self.llm = LLM(base, **ENGINE, **kwargs)
        self._ids = iter(range(1, 1000))

    def run(self, name: str | None, path: str | None, reference: PeftReference, as_adapter: str | None = None) -> int:
        lora = None if name is None else LoRARequest(name, next(self._ids), path)
        (out,) = self.llm.generate([PROMPT], GREEDY, lora_request=lora, use_tqdm=False)
        assert_matches_reference(reference, as_adapter or name, PROMPT, out.outputs[0])
        return out.num_cached_tokens

    def close(self) -> None:
        self.llm.close()


def test_no_hit_across_adapters_and_a_hit_across_names(setup):
    base, adapters, copy, ref = setup
    s = Session(base)
    try:
        assert [s.run("a", adapters["a"], ref), s.run("b", adapters["b"], ref), s.run(None, None, ref)] == [0, 0, 0]
        assert s.run("a", adapters["a"], ref) == HIT
        assert s.run("a-again", copy, ref, as_adapter="a") == HIT  # another name and path, the same content
        assert [s.run("b", adapters["b"], ref), s.run(None, None, ref)] == [HIT, HIT]
        assert s.run("c", adapters["c"], ref) == 0
    finally:
        s.close()


def test_no_hit_after_the_adapter_changes_at_the_same_path(setup, tmp_path):
    base, adapters, _, _ = setup
    path = str(tmp_path / "x")
    shutil.copytree(adapters["a"], path)
    s = Session(base)
    try:
        assert s.run("x", path, PeftReference(base, {"x": path})) == 0
        assert s.run("x", path, PeftReference(base, {"x": path})) == HIT
        make_adapter(base, path, **{**ADAPTER_SPECS["a"], "seed": 11})  # rewritten in place: new weights
        changed = PeftReference(base, {"x": path})
        assert s.run("x", path, changed) == 0  # and its tokens are the new weights' (the slot was reloaded)
        assert s.run("x", path, changed) == HIT
    finally:
        s.close()


def test_a_restart_with_the_cache_directory_gives_the_same_hits(setup, tmp_path):
    base, adapters, copy, ref = setup
    kv_dir = str(tmp_path / "kv")
    changing = str(tmp_path / "y")
    shutil.copytree(adapters["b"], changing)
    first = Session(base, kv_cache_dir=kv_dir)
    try:
        runs = [("a", adapters["a"]), ("b", adapters["b"]), (None, None), ("y", changing)]
        # y: a copy of b so far (the same content: a hit)
        assert [first.run(n, p, ref, as_adapter="b" if n == "y" else n) for n, p in runs] == [0, 0, 0, HIT]
    finally:
        first.close()  # writes what the directory still lacks
    make_adapter(base, changing, **{**ADAPTER_SPECS["b"], "seed": 12})
    second = Session(base, kv_cache_dir=kv_dir)
    try:
        assert second.run("a-copy", copy, ref, as_adapter="a") == HIT  # read from the directory
        assert [second.run("b", adapters["b"], ref), second.run(None, None, ref)] == [HIT, HIT]
        assert second.run("c", adapters["c"], ref) == 0  # never computed
        assert second.run("y", changing, PeftReference(base, {"y": changing})) == 0  # its old units are not its
        assert second.llm.get_metrics()["prefix_cache_disk_hits"] == 3 * HIT
    finally:
        second.close()
