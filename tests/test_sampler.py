"""Sampler: greedy, temperature, top-k / top-p / min-p, penalties, logprobs, per-request seeds."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers import penalties, token_draws
from deepinfer.model_executor.layers import sampler as sampler_module
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.sampling_inputs import build_sampling_metadata


def _row(request_id: str, params: SamplingParams, prompt=(1, 2, 3), output=()) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, token_ids=[0], start_pos=0, block_ids=([],),
                            sampling_params=params, prompt_token_ids=list(prompt),
                            output_token_ids=list(output))


def _metadata(rows: list[ScheduledRequest]) -> SamplingMetadata:
    return build_sampling_metadata(rows, torch.device("cpu"))


def _logits(num_rows: int, vocab_size: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [N, V]


def _draw_counts(logits_row: torch.Tensor, params: SamplingParams, num_draws: int,
                 seed: int = 0) -> torch.Tensor:
    """Samples `num_draws` tokens (unseeded rows from one seeded engine). -> counts [V]."""
    sampler = Sampler(seed=seed)
    batch = 2000
    rows = _metadata([_row(f"r{i}", params) for i in range(batch)])
    counts = torch.zeros(logits_row.shape[0])
    logits = logits_row.expand(batch, -1)  # [B, V]
    for _ in range(num_draws // batch):
        ids = torch.tensor([r.token_id for r in sampler(logits, rows)])
        counts += torch.bincount(ids, minlength=logits_row.shape[0])
    return counts


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic over the tokens with p > 0; counts on p = 0 tokens must be zero."""
    assert counts[probs == 0].sum() == 0, "a filtered token was sampled"
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum())


# chi-square critical values at p = 0.001 for df = 1 .. 7 (the draws are seeded: no flakes)
_CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = _logits(16, 1000).to(dtype)
    logits[0, [9, 3, 700]] = 100.0  # a tie: the first index wins, as in argmax
    rows = [_row(f"r{i}", SamplingParams(temperature=0.0)) for i in range(16)]
    out = Sampler()(logits, _metadata(rows))
    assert [r.token_id for r in out] == logits.float().argmax(dim=-1).tolist()
    assert out[0].token_id == 3


def test_greedy_rows_in_a_mixed_batch_are_argmax_and_logits_untouched():
    logits = _logits(8, 500)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0) if i % 2 else
              SamplingParams(temperature=0.9, top_k=20, top_p=0.8, min_p=0.01, seed=i) for i in range(8)]
    out = Sampler()(logits, _metadata([_row(f"r{i}", p) for i, p in enumerate(params)]))
    for i in range(1, 8, 2):
        assert out[i].token_id == int(logits[i].argmax())
    assert torch.equal(logits, before)
    all_random = [SamplingParams(temperature=0.9, top_k=20, min_p=0.01, repetition_penalty=1.2)] * 8
    Sampler()(logits, _metadata([_row(f"r{i}", p, output=[1, 2]) for i, p in enumerate(all_random)]))
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy_and_tiny_top_p_is_greedy():
    logits = _logits(32, 800, seed=1)
    greedy = logits.argmax(dim=-1).tolist()
    for params in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        for step in range(3):
            out = Sampler(seed=step)(logits, _metadata([_row(f"r{i}", params) for i in range(32)]))
            assert [r.token_id for r in out] == greedy


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0])  # [V]
    for temperature in (0.7, 1.0, 2.0):
        counts = _draw_counts(logits, SamplingParams(temperature=temperature), 20_000)
        probs = torch.softmax(logits / temperature, dim=-1)
        assert _chi_square(counts, probs) < _CHI2_CRIT[5]


def test_top_k_frequencies_match_renormalized_top_k():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 1.5, 0.0])
    counts = _draw_counts(logits, SamplingParams(temperature=1.0, top_k=3), 20_000)
    probs = torch.softmax(logits.masked_fill(logits < 1.0, float("-inf")), dim=-1)
    assert _chi_square(counts, probs) < _CHI2_CRIT[2]


def test_top_p_frequencies_match_the_nucleus():
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 1.5, 0.5])  # sorted p: .36 .22 .13 .08 .05 .03 ...
    probs = torch.softmax(logits, dim=-1)
    top_p = float(probs.topk(3).values.sum()) - 0.01  # the nucleus is exactly the best 3 tokens
    counts = _draw_counts(logits, SamplingParams(temperature=1.0, top_p=top_p), 20_000)
    nucleus = torch.softmax(logits.masked_fill(logits < 1.0, float("-inf")), dim=-1)
    assert _chi_square(counts, nucleus) < _CHI2_CRIT[2]


def test_min_p_filters_and_renormalizes():
    logits = torch.log(torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04]))
    counts = _draw_counts(logits, SamplingParams(temperature=1.0, min_p=0.3), 20_000)
    kept = torch.tensor([0.40, 0.25, 0.15, 0.0, 0.0, 0.0])  # p >= 0.3 * 0.40 = 0.12
    assert _chi_square(counts, kept / kept.sum()) < _CHI2_CRIT[2]


def _kept(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The tokens top-k / top-p keep. -> [N, V] bool."""
    weights = token_draws.exp_relative(logits, logits.amax(dim=-1, keepdim=True))  # [N, V]
    return logits >= token_draws._top_k_top_p_threshold(logits, weights, top_k, top_p)


@pytest.mark.parametrize("top_k", [0, 1, 40, 300, 3000])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999, 1.0])
@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])
def test_top_k_top_p_match_a_full_sort_reference(top_k, top_p, scale):
    logits = _logits(6, 5000, seed=7, scale=scale)  # scale 0.5: nuclei of thousands of tokens
    kept_mask = _kept(logits, [top_k] * 6, [top_p] * 6)  # [N, V]
    k = top_k or 5000
    values, order = logits.sort(dim=-1, descending=True)  # [N, V]
    probs = torch.softmax(values[:, :k].double(), dim=-1)  # [N, k]: renormalized over the top k
    mass_before = probs.cumsum(dim=-1) - probs  # [N, k]
    num_keep = (mass_before < top_p).sum(dim=-1)  # [N]
    for i in range(6):
        expected = set(order[i, : int(num_keep[i])].tolist())
        kept = set(torch.nonzero(kept_mask[i]).flatten().tolist())
        rank = {int(t): r for r, t in enumerate(order[i, :k])}
        for token in kept ^ expected:  # only fp32-vs-fp64 rounding right at the cut may differ
            assert token in rank and abs(float(mass_before[i, rank[token]]) - top_p) < 1e-5
        assert len(kept ^ expected) <= 1


def test_top_k_top_p_rows_are_filtered_independently():
    logits = _logits(4, 2000, seed=8)
    top_k, top_p = [0, 5, 0, 700], [1.0, 1.0, 0.5, 0.95]
    kept = _kept(logits, top_k, top_p)
    assert bool(kept[0].all()) and int(kept[1].sum()) == 5
    for i in (2, 3):
        assert torch.equal(_kept(logits[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])[0], kept[i])


def test_wide_logit_ranges_sample_correctly():
    logits = torch.tensor([0.0, -1.0, -300.0, float("-inf"), -2.0, -90.0])  # exp underflow ranges
    counts = _draw_counts(logits, SamplingParams(temperature=1.0), 10_000)
    probs = torch.softmax(logits, dim=-1)
    assert counts[2] == counts[3] == counts[5] == 0
    assert _chi_square(counts[[0, 1, 4]], probs[[0, 1, 4]] / probs[[0, 1, 4]].sum()) < _CHI2_CRIT[2]
    lse = sampler_module.logsumexp(logits[None])
    torch.testing.assert_close(lse, torch.logsumexp(logits[None], dim=-1))


def test_inverse_cdf_never_picks_filtered_tokens_and_covers_the_edges():
    probs = torch.zeros(3, 1000)
    probs[0, 0] = 1.0  # the first token only
    probs[1, 999] = 1.0  # the last token only (in the padded last block)
    probs[2, [255, 256, 511]] = torch.tensor([0.25, 0.5, 0.25])  # block edges
    for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 1.0 - 2**-53):
        ids = token_draws.inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64)).tolist()
        assert ids[:2] == [0, 999]
        assert ids[2] == (255 if u < 0.25 else 256 if u < 0.75 else 511)


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.2, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                            frequency_penalty=0.25)
    row = _row("r", params, prompt=[0, 1], output=[2, 2, 3])
    out = penalties.apply_penalties(logits, _metadata([row]))
    # repetition over {0, 1, 2, 3}: 2 -> 1, -1 -> -2, 0.5 -> 0.25, -3 -> -6
    # output counts {2: 2, 3: 1}: 0.25 - 0.5 - 2 * 0.25 = -0.75; -6 - 0.5 - 0.25 = -6.75
    expected = torch.tensor([[1.0, -2.0, -0.75, -6.75, 1.2, 0.0]])
    torch.testing.assert_close(out, expected)
    assert torch.equal(logits[0, 0], torch.tensor(2.0))  # the input is not modified
    assert Sampler()(logits, _metadata([row]))[0].token_id == 4  # without penalties greedy would pick 0
    assert Sampler()(logits, _metadata([_row("s", SamplingParams(temperature=0.0))]))[0].token_id == 0


def test_penalties_apply_only_to_their_rows_and_ignore_out_of_range_ids():
    logits = _logits(3, 50, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=0.0)]
    rows = [_row(f"r{i}", p, output=[int(logits[i].argmax()), 10_000]) for i, p in enumerate(params)]
    out = penalties.apply_penalties(logits, _metadata(rows))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    best = int(logits[1].argmax())
    assert out[1, best] == logits[1, best] - 2.0


def _dense_penalties(logits, prompt, output, rep, presence, frequency):
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).float()
    seen = torch.bincount(torch.tensor(prompt + output, dtype=torch.long), minlength=logits.shape[0]) > 0
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return out - frequency * counts - presence * (counts > 0).float()


def test_penalties_match_a_dense_reference_with_repeats_and_empty_histories():
    logits = _logits(5, 40, seed=4)
    histories = [([1, 2, 2, 3], [3, 3, 5, 1, 1, 1]), ([], []), ([7], []), ([], [0, 0, 39]),
                 ([4] * 9, [4] * 3 + [6])]
    settings = [(1.5, 0.7, 0.2), (1.3, 0.5, 0.5), (0.8, -0.4, 1.0), (1.0, 1.0, -0.3), (2.0, 0.0, 0.0)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r, presence_penalty=pp, frequency_penalty=f)
              for r, pp, f in settings]
    rows = [_row(f"r{i}", p, prompt=h[0], output=h[1]) for i, (p, h) in enumerate(zip(params, histories,
                                                                                        strict=True))]
    out = penalties.apply_penalties(logits, _metadata(rows))
    for i, ((prompt, output), (r, pp, f)) in enumerate(zip(histories, settings, strict=True)):
        torch.testing.assert_close(out[i], _dense_penalties(logits[i], prompt, output, r, pp, f))


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = _logits(4, 300, seed=5)
    params = [SamplingParams(temperature=0.8, logprobs=5, repetition_penalty=1.3, seed=1),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=3, logprobs=2)]
    out = Sampler()(logits, _metadata([_row(f"r{i}", p) for i, p in enumerate(params)]))
    reference = torch.log_softmax(logits, dim=-1)  # [N, V]
    for i, result in enumerate(out):
        assert result.logprob == pytest.approx(float(reference[i, result.token_id]), abs=1e-5)
    assert out[1].top_logprobs == [] and out[2].top_logprobs is None
    for i, n in ((0, 5), (3, 2)):
        values, ids = reference[i].topk(n)
        assert [t for t, _ in out[i].top_logprobs] == ids.tolist()
        assert [lp for _, lp in out[i].top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        assert sorted(out[i].top_logprobs, key=lambda pair: -pair[1]) == out[i].top_logprobs


def test_logprobs_of_half_precision_logits_are_computed_in_fp32():
    logits = _logits(2, 100, seed=9).to(torch.bfloat16)
    rows = [_row(f"r{i}", SamplingParams(temperature=0.0, logprobs=1)) for i in range(2)]
    out = Sampler()(logits, _metadata(rows))
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, result in enumerate(out):
        assert result.logprob == pytest.approx(float(reference[i].max()), abs=1e-5)


def _step_logits(history: list[int], vocab_size: int) -> torch.Tensor:
    """A deterministic stand-in for a model: logits that depend on the request's history."""
    generator = torch.Generator().manual_seed(hash(tuple(history)) % (2**31))
    return torch.randn(vocab_size, generator=generator) * 2  # [V]


def _generate(batches: list[list[tuple[str, SamplingParams]]], num_steps: int, vocab_size: int = 64,
              sampler: Sampler | None = None) -> dict[str, list[int]]:
    """Runs every batch for `num_steps` decode steps through one sampler; -> id -> tokens.

    Batches run interleaved step by step, so the same sampler sees different compositions.
    """
    sampler = sampler or Sampler(seed=123)
    outputs = {rid: [] for batch in batches for rid, _ in batch}
    prompts = {rid: [len(rid), 7, 3] for rid in outputs}
    for _ in range(num_steps):
        for batch in batches:
            rows = [_row(rid, p, prompt=prompts[rid], output=outputs[rid]) for rid, p in batch]
            logits = torch.stack([_step_logits(prompts[rid] + outputs[rid], vocab_size)
                                  for rid, _ in batch])  # [N, V]
            for (rid, _), result in zip(batch, sampler(logits, _metadata(rows)), strict=True):
                outputs[rid].append(result.token_id)
    return outputs


def test_seeded_request_is_independent_of_batch_composition_and_order():
    target = SamplingParams(temperature=1.0, top_p=0.9, top_k=40, presence_penalty=0.5, seed=4242)
    alone = _generate([[("target", target)]], num_steps=6)["target"]
    others = [("a", SamplingParams(temperature=1.0)), ("b", SamplingParams(temperature=0.0)),
              ("c", SamplingParams(temperature=0.7, min_p=0.1, seed=9)),
              ("d", SamplingParams(temperature=1.3, top_k=5))]
    compositions = [[("target", target)] + others, others[::-1] + [("target", target)],
                    others[:2] + [("target", target)] + others[2:3], [others[3], ("target", target)]]
    for batch in compositions:
        assert _generate([batch], num_steps=6)["target"] == alone
    assert len(set(alone)) > 1  # it really sampled


def test_same_seed_gives_same_tokens_for_two_requests_in_one_batch():
    params = SamplingParams(temperature=1.0, seed=77)
    first = _generate([[("x", params), ("y", params)]], num_steps=5)
    # equal prompt lengths give equal histories, hence equal logits: equal seeds -> equal tokens
    assert first["x"] == first["y"]
    assert first["x"] == _generate([[("y", params)]], num_steps=5)["y"]


def test_unseeded_requests_follow_the_engine_seed():
    batch = [(f"r{i}", SamplingParams(temperature=1.0)) for i in range(4)]
    assert _generate([batch], 4, sampler=Sampler(seed=5)) == _generate([batch], 4, sampler=Sampler(seed=5))
    assert _generate([batch], 4, sampler=Sampler(seed=5)) != _generate([batch], 4, sampler=Sampler(seed=6))


def test_release_drops_generators_and_restarts_the_seed():
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, seed=3)
    logits = torch.zeros(1, 1000)  # uniform: the token is a direct image of the uniform draw
    first = [sampler(logits, _metadata([_row("r", params)]))[0].token_id for _ in range(4)]
    assert sampler.num_request_generators == 1
    sampler.release(["r", "unknown"])
    assert sampler.num_request_generators == 0
    assert [sampler(logits, _metadata([_row("r", params)]))[0].token_id for _ in range(4)] == first


def test_bad_input_is_refused():
    sampler = Sampler()
    with pytest.raises(ValueError, match="logits must be"):
        sampler(torch.zeros(2, 10), _metadata([_row("r", SamplingParams())]))
    row = ScheduledRequest(request_id="r", token_ids=[0], start_pos=0, block_ids=([],))
    with pytest.raises(ValueError, match="without sampling_params"):
        _metadata([row])
    assert sampler(torch.zeros(0, 10), _metadata([])) == []


def test_tiny_temperature_stays_finite():
    logits = _logits(4, 100, seed=11) * 10
    out = Sampler()(logits, _metadata([_row(f"r{i}", SamplingParams(temperature=1e-30)) for i in range(4)]))
    assert [r.token_id for r in out] == logits.argmax(dim=-1).tolist()
    assert all(math.isfinite(r.logprob) for r in out)


def test_metadata_refuses_a_row_without_params():
    with pytest.raises(ValueError, match="'second'"):
        SamplingMetadata.from_rows(["first", "second"], [SamplingParams(), None], [[1], [2]], [[], []], "cpu")
