"""Greedy identity: with drafts verified over the paged, ring and compressed caches, greedy output
is token-identical to plain decoding, for every architecture, with preemption and an abort forced
in the same runs, and the pools full again afterwards."""

from __future__ import annotations

import random

import pytest
from spec_helpers import ScriptedDrafter, mixed, run_engine

from deepinfer import LLM, SamplingParams

pytestmark = [pytest.mark.parity]

K = 4
ARCHS = ["llama", "qwen2", "qwen3", "mistral_swa", "qwen2_swa", "gemma3"]
# a small pool (block_size 4) and budget: four requests of ~70 tokens cannot all stay resident
ENGINE = dict(block_size=4, num_blocks=36, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=144)  # 36 x 4
VOCAB = 1024  # tiny checkpoints with a small head: the logits, not the model, would dominate


def _prompts(seed: int = 0, vocab: int = 1000) -> list[list[int]]:
    rng = random.Random(seed)
    phrase = [rng.randrange(3, vocab) for _ in range(9)]
    return [phrase * 3, [rng.randrange(3, vocab) for _ in range(21)], phrase[:4] * 5, [rng.randrange(3, vocab)] * 6]


def _greedy(max_tokens: int = 44) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _plain_and_spec(path: str, prompts, drafter_wrong=mixed, method="ngram", **engine):
    """Plain greedy continuations (the truth), then the same prompts with scripted drafts verified."""
    engine = {**ENGINE, **engine}
    plain_llm = LLM(path, **engine)
    plain = run_engine(plain_llm, prompts, _greedy(), abort=2)
    truth = run_engine(plain_llm, prompts, _greedy())
    spec_llm = LLM(path, speculative_method=method, num_speculative_tokens=K, **engine)
    vocab = spec_llm.engine.source.hf_config.vocab_size
    spec_llm.engine.runner.steps.drafter = ScriptedDrafter({tuple(p): truth[i] for i, p in enumerate(prompts)}, K,
                                                           vocab, drafter_wrong)
    spec = run_engine(spec_llm, prompts, _greedy(), abort=2)
    return plain, spec, plain_llm.get_metrics(), spec_llm.get_metrics()


@pytest.mark.parametrize("arch", ARCHS)
def test_scripted_drafts_keep_greedy_output(tiny_checkpoint, arch):
    plain, spec, plain_metrics, metrics = _plain_and_spec(tiny_checkpoint(arch, vocab_size=VOCAB), _prompts())
    assert spec == plain and len(spec) == 3
    if metrics["num_total_blocks"]:  # paged groups grow and preempt; rings alone never grow
        assert metrics["num_preemptions"] > 0 and plain_metrics["num_preemptions"] > 0
    accepted, drafted = metrics["spec_decode_num_accepted_tokens"], metrics["spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted  # verification steps that kept all, some and none of their drafts
    assert metrics["spec_decode_num_accepted_tokens_per_pos"][K - 1] > 0


@pytest.mark.parametrize("arch", ["llama", "mistral_swa"])
def test_ngram_drafts_keep_greedy_output(tiny_checkpoint, arch):
    """The real proposer: prompt lookup over prompts that repeat themselves."""
    path = tiny_checkpoint(arch, vocab_size=VOCAB)
    prompts = _prompts(1)
    plain = run_engine(LLM(path, **ENGINE), prompts, _greedy(), abort=1)
    llm = LLM(path, speculative_method="ngram", num_speculative_tokens=K, **ENGINE)
    assert run_engine(llm, prompts, _greedy(), abort=1) == plain
    assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


def test_window_wraps_inside_verification_steps(tiny_checkpoint):
    """Mistral with W = 16 and S = W + k + 1 = 21 (k = 4): 60-token sequences wrap the ring
    twice, and verification steps of k + 1 = 5 rows straddle the wrap points."""
    path = tiny_checkpoint("mistral_swa", vocab_size=VOCAB)
    llm = LLM(path, speculative_method="ngram", num_speculative_tokens=K, **ENGINE)
    ring = next(g for g in llm.engine.runner.groups if g.is_ring)
    assert (ring.window, ring.rows_per_unit) == (16, 21)
    wraps = []
    prompts = _prompts(2)
    truth = run_engine(LLM(path, **ENGINE), prompts, _greedy())
    llm.engine.runner.steps.drafter = ScriptedDrafter({tuple(p): truth[i] for i, p in enumerate(prompts)}, K,
                                                llm.engine.source.hf_config.vocab_size, mixed)

    def record(engine):
        for req in engine.scheduler.running:
            wraps.append(req.num_computed_tokens // 21)
    assert run_engine(llm, prompts, _greedy(), on_step=record) == truth
    assert max(wraps) >= 2


@pytest.mark.real_model
@pytest.mark.slow
def test_gemma3_real_ngram_greedy_identity(gemma3_gguf_path):
    _real_model_identity(gemma3_gguf_path)


@pytest.mark.slow
def test_smollm2_real_ngram_greedy_identity():
    _real_model_identity(None)


def _real_model_identity(path):
    """A real model copying text: prompt lookup drafts are mostly right, output is unchanged."""
    text = ("Repeat the following sentence three times: The little red fox jumps over the old stone wall "
            "near the river.")
    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompts = [text, "Count from one to twenty:"]
    plain = LLM(path, max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, max_num_seqs=2, speculative_method="ngram")
    spec = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_accepted_tokens"] > 10
    llm.engine.kv_manager.check_no_leaks()
