"""Every model family beyond the Llama family runs on the engine's shared paths: prefix caching and
n-gram speculative decoding, on tiny random fp32 checkpoints (tests/family_checkpoints.py: Qwen3-MoE,
Qwen2-MoE, Mixtral, Gemma 2, Phi-3 with a window on every layer, DeepSeek-V3 and V2, GPT-OSS with
MXFP4 experts).

- Prefix caching: after a request finishes, one sharing its 72-token prefix (9 blocks of 8) and one
  with its whole prompt hit the cache (paged layers: every full block; ring layers: the snapshot
  at 64 tokens), and all three give the greedy tokens of an engine with caching off. Their
  logprobs are bit-identical where the family runs the batch-invariant CPU default (Gemma 2,
  Phi-3); elsewhere a hit's suffix is computed by matmuls of other shapes than the full prompt's,
  and the logprobs differ by at most 9.5e-7 (measured: MoE families, DeepSeek, GPT-OSS), under 1e-5.
- n-gram speculative decoding: two prompts that repeat a phrase, run as one batch: greedy tokens with
  prompt-lookup drafts (k = 4) verified equal the caching-off engine's plain decoding, and some drafts
  were accepted.

One engine per (family, setting), built once per module; prefill is chunked at 37 tokens.
"""

from __future__ import annotations

import random

import pytest
from family_checkpoints import FAMILIES, make_family_checkpoint

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.parity]

EXACT = ("gemma2", "phi3")  # the batch-invariant CPU default covers these model types
TOL = 1e-5  # the other families: measured at most 9.5e-7 (fp32 matmuls of other row counts)
PREFIX_LEN = 72
ENGINE = dict(dtype="float32", block_size=8, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=37,
              prefix_snapshot_interval=32)
SETTINGS = {"off": dict(enable_prefix_caching=False), "cached": {},
            "ngram": dict(enable_prefix_caching=False, speculative_method="ngram", num_speculative_tokens=4)}
LOGPROBS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """checkpoint(family) -> (directory, vocabulary size), built once per module."""
    built: dict[str, tuple[str, int]] = {}

    def build(family: str) -> tuple[str, int]:
        if family not in built:
            path = str(tmp_path_factory.mktemp(f"family-{family}"))
            built[family] = path, make_family_checkpoint(family, path, tokenizer_dir)
        return built[family]

    return build


@pytest.fixture(scope="module")
def engine(checkpoint):
    """engine(family, setting) -> an LLM of SETTINGS[setting], built once per module."""
    built: dict[tuple[str, str], LLM] = {}

    def build(family: str, setting: str) -> LLM:
        if (family, setting) not in built:
            built[family, setting] = LLM(checkpoint(family)[0], **ENGINE, **SETTINGS[setting])
        return built[family, setting]

    yield build
    for llm in built.values():
        llm.engine.close()


def _one_by_one(llm: LLM, prompts, params: SamplingParams) -> list:
    """Outputs of each prompt run alone to the end, in order; every block is back in the pool."""
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    llm.engine.kv_manager.check_no_leaks()
    return outs


def _together(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    """Output tokens of the prompts run as one batch; every block is back in the pool."""
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine.kv_manager.check_no_leaks()
    return outs


def _shared_prefix_prompts(vocab: int, seed: int) -> list[list[int]]:
    """A prompt, one sharing its first PREFIX_LEN tokens with another tail, and the first again."""
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(PREFIX_LEN)]
    first = base + [rng.randrange(3, vocab) for _ in range(9)]
    return [first, base + [rng.randrange(3, vocab) for _ in range(5)], first]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_hits_change_no_output(family, checkpoint, engine):
    prompts = _shared_prefix_prompts(checkpoint(family)[1], seed=len(family))
    ref_llm, llm = engine(family, "off"), engine(family, "cached")
    assert ref_llm.engine.runner.batch_invariant == llm.engine.runner.batch_invariant == (family in EXACT)
    ref = _one_by_one(ref_llm, prompts, LOGPROBS)
    outs = _one_by_one(llm, prompts, LOGPROBS)
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0 and 64 <= cached[1] <= PREFIX_LEN and cached[2] >= 64, cached
    assert llm.get_metrics()["prefix_cache_hits"] >= sum(cached)
    for i, (r, o) in enumerate(zip(ref, outs, strict=True)):
        rc, oc = r.outputs[0], o.outputs[0]
        assert oc.token_ids == rc.token_ids, (i, cached[i], rc.token_ids, oc.token_ids)
        diffs = [abs(oc.logprobs[j][t].logprob - rc.logprobs[j][t].logprob) for j, t in enumerate(rc.token_ids)]
        assert max(diffs) == 0.0 if family in EXACT else max(diffs) < TOL, (i, cached[i], max(diffs))


def _repeating_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab) for _ in range(9)]
    return [phrase * 3, phrase[:4] * 5]


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_drafts_keep_greedy_output(family, checkpoint, engine):
    prompts = _repeating_prompts(checkpoint(family)[1], seed=len(family))
    plain = _together(engine(family, "off"), prompts, GREEDY)
    llm = engine(family, "ngram")
    assert _together(llm, prompts, GREEDY) == plain
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_accepted_tokens"] > 0, metrics
