"""Prefix caching changes no output: greedy tokens with hits equal those with caching off, and
logprobs agree within 1e-4 (fp32), on tiny random checkpoints of every cache layout (paged,
ring only, paged + ring, DeepSeek-V4 rings + compressed groups) and on the two real models.

Each run shares long prefixes (> 2 snapshot intervals of 32 tokens), has identical prompts,
chunks prefill at 37 tokens (a multiple of no block size), and is short of cache so requests are
preempted (or, ring-only, wait for a state slot); it runs once as one batch and once request by
request, and every block, state slot and snapshot pin must come back.

Cache keys must change with everything that changes K/V: the salt, the weights' bytes at the
same path, the compute dtype and the row format give no hits.
"""

from __future__ import annotations

import os
import random
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "deepseek_v4"))

from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.parity]

MAX_TOKENS = 4
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
# max_model_len 160: the tight pools below (10 blocks of 16; V4: 24 of 4) hold one request at it
COMMON = dict(max_num_batched_tokens=37, max_model_len=160, prefix_snapshot_interval=32)

# per model: caching-off kwargs, and the kwargs of the cached runs that run short of cache
TINY = {
    "llama": dict(num_blocks=10),
    "qwen2": dict(num_blocks=10),
    "mistral_swa": dict(max_num_seqs=2, num_prefix_snapshots=8),  # ring only: requests wait for a slot
    "qwen2_swa": dict(num_blocks=10),
    "gemma3": dict(num_blocks=10),
}
V4_LAYERS = [SLIDING, CSA, HCA, CSA]
V4_KW = dict(block_size=4, num_blocks=24)  # csa/index blocks: 16 tokens, hca: 32 tokens


def shared_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Prompts over one 80-token prefix (2.5 snapshot intervals): distinct tails, an identical
    pair, a shorter part of the prefix."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(80)]
    tails = [[rng.randrange(3, vocab) for _ in range(n)] for n in (14, 31, 6, 13)]  # decodes cross block edges
    return [base + tails[0], base + tails[1], base + tails[0], base[:56] + tails[2], base + tails[3]]


def run(llm: LLM, prompts, sequential: bool, **add_kw):
    """Greedy outputs in prompt order, run as one batch or one request at a time."""
    engine, finished = llm.engine, {}

    def drain():
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)

    ids = []
    for prompt in prompts:
        ids.append(engine.add_request(prompt, PARAMS, **add_kw))
        if sequential:
            drain()
    drain()
    engine.kv_manager.check_no_leaks()
    return [finished[i] for i in ids]


def assert_same(ref, outs, tol: float = 1e-4) -> None:
    for i, (r, o) in enumerate(zip(ref, outs, strict=True)):
        rc, oc = r.outputs[0], o.outputs[0]
        assert oc.token_ids == rc.token_ids, (i, o.num_cached_tokens, rc.token_ids, oc.token_ids)
        for j, t in enumerate(rc.token_ids):
            assert abs(oc.logprobs[j][t].logprob - rc.logprobs[j][t].logprob) < tol, \
                (i, j, oc.logprobs[j][t], rc.logprobs[j][t])


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("v4-prefix"))
    make_tiny_v4(path, V4_LAYERS)
    return path


def check_parity(path: str, vocab: int, cached_kw: dict, ref_kw: dict, paged: bool, seed: int) -> None:
    prompts = shared_prompts(vocab, seed)
    ref = run(LLM(path, enable_prefix_caching=False, **COMMON, **ref_kw), prompts, sequential=False)

    llm = LLM(path, **COMMON, **cached_kw)
    kv = llm.engine.kv_manager
    assert kv.caching
    batch = run(llm, prompts, sequential=False)  # from an empty cache, short of blocks or slots
    assert_same(ref, batch)
    if paged:
        assert llm.engine.scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"
    else:
        assert llm.engine.runner.num_state_slots == 2, "requests were meant to wait for a state slot"
    cached = [o.num_cached_tokens for o in batch]
    # the first computes everything; the identical prompt and the last one wait behind it and hit
    assert cached[0] == 0 and cached[2] > 0 and cached[4] > 0, cached

    seq = run(llm, prompts, sequential=True)  # request by request on what the batch left
    assert_same(ref, seq)
    cached = [o.num_cached_tokens for o in seq]
    assert all(c > 0 for c in cached), cached
    assert max(cached) >= 64, "the shared prefix is hit past two snapshot intervals"
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_hits"] >= sum(o.num_cached_tokens for o in batch + seq)
    if kv.needs_snapshots:
        assert metrics["prefix_cache_snapshots"] > 0
    kv.check_no_leaks()


@pytest.mark.parametrize("arch", list(TINY))
def test_hits_change_no_output(arch, tiny_checkpoint):
    paged = arch != "mistral_swa"
    check_parity(tiny_checkpoint(arch), 49152, TINY[arch], {}, paged, seed=len(arch))


def test_v4_hits_change_no_output(v4_path):
    from v4_tiny import VOCAB

    check_parity(v4_path, VOCAB, V4_KW, dict(block_size=4, num_blocks=200), paged=True, seed=4)


# ---- what must not hit ------------------------------------------------------------------------------

def test_different_cache_salt_never_hits(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = shared_prompts(49152, seed=11)[:2]
    llm = LLM(path, **COMMON)
    first = run(llm, prompts[:1], sequential=True, cache_salt="tenant-a")
    assert first[0].num_cached_tokens == 0
    other = run(llm, prompts, sequential=True, cache_salt="tenant-b")
    unsalted = run(llm, prompts, sequential=True)
    same = run(llm, prompts, sequential=True, cache_salt="tenant-a")
    assert other[0].num_cached_tokens == 0 and unsalted[0].num_cached_tokens == 0
    assert other[1].num_cached_tokens > 0, "within one salt prefixes are shared"
    assert same[0].num_cached_tokens > 0 and same[1].num_cached_tokens > 0
    for outs in (other, unsalted, same):
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in other]
    assert first[0].outputs[0].token_ids == other[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request(prompts[0], PARAMS, cache_salt=7)
    llm.engine.kv_manager.check_no_leaks()


def _change_one_tensor(path: str) -> None:
    """Rewrite the checkpoint's safetensors at the same path with the LM head scaled."""
    import torch
    from safetensors.torch import load_file, save_file

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) == 1
    file = os.path.join(path, files[0])
    tensors = load_file(file)
    name = next(n for n in tensors if "lm_head" in n)
    tensors[name] = (tensors[name] * 1.5 + 0.01 * torch.randn_like(tensors[name])).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


def test_changed_weights_at_the_same_path_never_hit(tiny_checkpoint, tmp_path):
    path = str(tmp_path / "model")
    shutil.copytree(tiny_checkpoint("llama"), path)
    cache_dir = str(tmp_path / "kv")
    prompt = shared_prompts(49152, seed=12)[0]
    kw = dict(COMMON, kv_cache_dir=cache_dir)
    with LLM(path, **kw) as llm:
        before = run(llm, [prompt], sequential=True)[0]
    with LLM(path, **kw) as llm:  # control: unchanged weights read the saved blocks
        again = run(llm, [prompt], sequential=True)[0]
        assert again.num_cached_tokens > 0 and llm.get_metrics()["prefix_cache_disk_hits"] > 0
    assert again.outputs[0].token_ids == before.outputs[0].token_ids
    _change_one_tensor(path)
    with LLM(path, **kw) as llm:
        changed = run(llm, [prompt], sequential=True)[0]
        metrics = llm.get_metrics()
    assert changed.num_cached_tokens == 0 and metrics["prefix_cache_disk_hits"] == 0
    ref = run(LLM(path, enable_prefix_caching=False, **COMMON), [prompt], sequential=True)[0]
    assert_same([ref], [changed])
    assert changed.outputs[0].logprobs != before.outputs[0].logprobs, "the change was meant to show"


@pytest.mark.parametrize("change", [dict(dtype="bfloat16"), dict(kv_cache_dtype="bfloat16")],
                         ids=["dtype", "kv_cache_dtype"])
def test_changed_dtype_or_row_format_never_hits(change, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen2")
    cache_dir = str(tmp_path / "kv")
    prompt = shared_prompts(49152, seed=13)[0]
    with LLM(path, kv_cache_dir=cache_dir, **COMMON) as llm:
        run(llm, [prompt], sequential=True)
    with LLM(path, kv_cache_dir=cache_dir, **COMMON, **change) as llm:
        out = run(llm, [prompt], sequential=True)[0]
        assert out.num_cached_tokens == 0 and llm.get_metrics()["prefix_cache_disk_hits"] == 0
        again = run(llm, [prompt], sequential=True)[0]
        assert again.num_cached_tokens > 0, "its own blocks still hit"
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert len([d for d in os.listdir(cache_dir) if not d.startswith(".")]) == 2, "one folder per identity"


# ---- the real models --------------------------------------------------------------------------------

NATURAL_PREFIX = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
    "faster than scribes. Within a few decades, presses had spread to more than two hundred cities across "
    "Europe, and the number of books in circulation grew from thousands to millions. ")
QUESTIONS = ["Question: who invented it? Answer:", "Summarize this in one sentence:",
             "Question: how fast did it spread? Answer:"]


def check_real_model(model, **kw) -> None:
    """One engine (a real model loads slowly): the prompts with caching switched off in its KV
    manager (no lookups, snapshots or registrations, as `enable_prefix_caching=False`), then
    with caching on: one warms the cache, the others hit it.

    On the reference path (`quantization="none"`): on the default path a 3-prompt prefill of
    > 128 rows may run its GEMMs in bf16 while a hit's short suffix runs in fp32, so logprobs
    differ at bf16 rounding (~0.02) for reasons that are not the cache's."""
    prompts = [NATURAL_PREFIX + q for q in QUESTIONS]
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=0)
    llm = LLM(model, quantization="none", dtype="float32", **kw)
    kv = llm.engine.kv_manager
    kv.prefix.enabled = False
    assert not kv.caching
    ref = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in ref) and kv.num_cached_blocks == 0
    kv.prefix.enabled = True
    assert kv.caching
    outs = llm.generate(prompts[:1], params, use_tqdm=False)  # warms the cache
    outs += llm.generate(prompts[1:], params, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 32 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    assert_same(ref, outs, tol=1e-3)
    assert any(o.outputs[0].text.strip() for o in outs)
    kv.check_no_leaks()


@pytest.mark.slow
def test_default_model_hits_change_no_output():
    check_real_model(None, max_model_len=256, kv_cache_memory="64MiB")


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_270m_hits_change_no_output(gemma3_gguf_path):
    check_real_model(gemma3_gguf_path, max_model_len=256, prefix_snapshot_interval=32)
