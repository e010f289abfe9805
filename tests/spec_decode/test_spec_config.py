"""Bad speculative settings are refused at start-up with the field and the value; the draft
allowance sizes the rings; a ring below the book's bound would corrupt verification."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM
from deepinfer.config import SpeculativeConfig
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.entrypoints.cli import build_parser
from deepinfer.entrypoints.engine_args import engine_kwargs
from deepinfer.worker.input_batch import build_step_inputs


@pytest.mark.parametrize("kwargs, match", [
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens .* got 0"),
    (dict(method="ngram", num_speculative_tokens=33), "got 33"),
    (dict(method="mtp", num_speculative_tokens=-1), "got -1"),
    (dict(method="ngram", num_speculative_tokens=2.5), "got 2.5"),
    (dict(method="eagle"), "speculative_method .* got 'eagle'"),
    (dict(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min=3"),
])
def test_bad_settings_name_the_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kwargs)


def test_mtp_on_a_model_without_mtp_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="speculative_method='mtp'.*'llama' has none"):
        LLM(tiny_checkpoint("llama"), speculative_method="mtp")


def test_every_subcommand_takes_the_flags():
    parser = build_parser()
    for command in (["generate", "hi"], ["chat"], ["info"], ["bench"], ["serve"]):
        args = parser.parse_args(command + ["--speculative-method", "ngram", "--num-speculative-tokens", "3"])
        assert engine_kwargs(args)["speculative_method"] == "ngram"
        assert engine_kwargs(args)["num_speculative_tokens"] == 3


def test_k_sizes_the_ring(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("mistral_swa"), speculative_method="ngram", num_speculative_tokens=9)
    ring = next(g for g in llm.engine.runner.groups if g.is_ring)
    assert ring.rows_per_unit == ring.window + 10  # S = W + max(backtracking 0, k + 1)
    assert llm.engine.runner.steps.drafter.k == 9


def _positions_read(llm, p: int, k: int) -> list[list[int]]:
    """On the runner's real cache and metadata: store rows holding their own position for a
    prefill of p tokens, then a k + 1 verification step (store, then read through each query's
    index row). Returns the positions each of the k + 1 queries actually read."""
    runner = llm.engine.runner
    view = runner.caches.cache.group_caches(0)[0]  # layer 0 of the ring group

    def store(step: ScheduledRequest) -> list:
        g = build_step_inputs(StepPlan([step]), runner.caches.addressing, runner.device).attn_metadata.groups[0]
        pos = torch.arange(step.start_pos, step.start_pos + step.num_tokens, dtype=torch.float32)
        pos = pos if g.store_rows is None else pos[g.store_rows]
        rows = pos[:, None, None].expand(-1, view.codec.num_kv_heads, view.codec.head_dim)  # [n, H_kv, D]
        view.store(g.store_slots, rows, rows)
        return g

    store(ScheduledRequest("r", [1] * p, 0, (), (0,)))
    g = store(ScheduledRequest("r", [1] * (k + 1), p, (), (0,), verify=True))
    loaded = view.load(g.decode_index)[..., 0, 0, 0]  # [k + 1, W]: K of head 0, channel 0
    return [[int(x) for x, ok in zip(row, index >= 0, strict=True) if ok]
            for row, index in zip(loaded.tolist(), g.decode_index, strict=True)]


@pytest.mark.slow
def test_an_undersized_ring_corrupts_verification_and_the_chosen_one_does_not(tiny_checkpoint, monkeypatch):
    """k + 1 stores, then each query reads its window W through its index row. The engine's
    S = W + max(6, k + 1) keeps every row; at S = W + k - 1 the store of p + k lands on the slot of
    p - W + 1, which query p still reads (the book's hazard, §3.5.1)."""
    from deepinfer.worker import cache_sizing

    path, k, p = tiny_checkpoint("mistral_swa"), 5, 47
    window = [list(range(q - 15, q + 1)) for q in range(p, p + k + 1)]  # W = 16
    good = LLM(path, speculative_method="ngram", num_speculative_tokens=k, max_num_seqs=2)
    assert good.engine.runner.groups[0].rows_per_unit == 16 + k + 1
    assert [sorted(r) for r in _positions_read(good, p, k)] == window

    monkeypatch.setattr(cache_sizing, "ring_size", lambda w, env, drafts: w + k - 1)
    monkeypatch.setattr(cache_sizing, "check_ring_fits_drafts", lambda *args: None)  # past the refusal
    bad = LLM(path, speculative_method="ngram", num_speculative_tokens=k, max_num_seqs=2)
    assert bad.engine.runner.groups[0].rows_per_unit == 16 + k - 1
    read = _positions_read(bad, p, k)
    assert sorted(read[0]) == window[0][1:] + [p + k]  # p - 15 was overwritten by p + 5
    assert [sorted(r) for r in read[1:]] == window[1:]  # the later queries lost nothing


def test_the_start_up_refuses_a_ring_below_the_bound(tiny_checkpoint, monkeypatch):
    from deepinfer.worker import cache_sizing

    monkeypatch.setattr(cache_sizing, "ring_size", lambda w, env, drafts: w + 3)
    with pytest.raises(ValueError, match="S=19 .* W=16 .* k=5: need S >= W \\+ k \\+ 1 = 22"):
        LLM(tiny_checkpoint("mistral_swa"), speculative_method="ngram", num_speculative_tokens=5)
