"""The sampler's fast paths choose what its general path chooses: the blocked argmax equals
torch's max (ties, NaN, -inf, any vocabulary size), an all-greedy batch gives the general path's
tokens and logprobs bit for bit, and plain-temperature rows (seeded or not) draw the same tokens
from the same uniforms, one draw per request per step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers.sampler import Sampler, logsumexp
from deepinfer.model_executor.layers.token_draws import row_max
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.sampling_inputs import build_sampling_metadata


def _row(request_id: str, params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, token_ids=[0], start_pos=0, block_ids=([],),
                            sampling_params=params, prompt_token_ids=[1, 2, 3], output_token_ids=[4])


def _metadata(rows):
    return build_sampling_metadata(rows, torch.device("cpu"))


def _logits(num_rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3  # [N, V]


@pytest.mark.parametrize("vocab_size", [7, 256, 511, 512, 1000, 49152, 49153])
def test_row_max_equals_torch_max(vocab_size):
    logits = _logits(9, vocab_size)  # [9, V]
    logits[1, :] = 2.0  # all tied: the first index
    logits[2, vocab_size // 3] = logits[2, -1] = 50.0  # a tie across blocks (and with the tail)
    logits[3, :] = float("-inf")
    logits[4, vocab_size // 2] = float("nan")
    logits[5, -1] = 60.0  # the max in the last column
    logits[6, :5] = 70.0  # a tie inside the first block
    logits[7, [0, -1]] = float("nan")
    values, index = row_max(logits)
    ref_values, ref_index = logits.max(dim=-1)
    assert torch.equal(index, ref_index)
    assert torch.equal(values.nan_to_num(), ref_values.nan_to_num())
    assert torch.equal(values.isnan(), ref_values.isnan())


def test_all_greedy_fast_path_equals_the_general_path():
    """Tokens: torch's argmax; logprobs: the token's logit minus logsumexp, bit for bit."""
    logits = _logits(32, 49152, seed=3)
    logits[5, 100] = logits[5, 40000] = logits[5].max() + 1  # a tie
    rows = [_row(f"r{i}", SamplingParams(temperature=0.0)) for i in range(32)]
    out = Sampler()(logits, _metadata(rows))
    ids = logits.max(dim=-1).indices  # [N]
    logprobs = logits.gather(1, ids[:, None])[:, 0] - logsumexp(logits)  # [N]
    assert [r.token_id for r in out] == ids.tolist()
    assert [r.logprob for r in out] == logprobs.tolist()
    assert out[5].token_id == 100


def test_greedy_rows_with_penalties_or_logprobs_agree_with_the_fast_path():
    """A penalty row sends the batch through the general path; the other rows do not change."""
    logits = _logits(4, 3000, seed=4)
    plain = Sampler()(logits, _metadata([_row(f"r{i}", SamplingParams(temperature=0.0)) for i in range(4)]))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.5), SamplingParams(temperature=0.0, logprobs=0)]
    general = Sampler()(logits, _metadata([_row(f"r{i}", p) for i, p in enumerate(params)]))
    same = [0, 1, 3]
    assert [(plain[i].token_id, plain[i].logprob) for i in same] == [(general[i].token_id, general[i].logprob)
                                                                     for i in same]
    assert general[1].top_logprobs[0][0] == general[1].token_id and general[3].top_logprobs == []


def _as_general(metadata):
    """The same rows through the filter stage (top-k 0, top-p 1, min-p 0: it filters nothing)."""
    return dataclasses.replace(metadata, any_filter=True)


@pytest.mark.parametrize("seeded", [False, True])
def test_plain_temperature_fast_path_draws_what_the_general_path_draws(seeded):
    rows = [_row(f"r{i}", SamplingParams(temperature=0.5 + 0.1 * i, seed=100 + i if seeded else None))
            for i in range(6)]
    rows[2] = _row("r2", SamplingParams(temperature=0.0))  # a greedy row in the batch
    fast, general = Sampler(seed=7), Sampler(seed=7)
    for step in range(20):
        logits = _logits(6, 5000, seed=step)
        metadata = _metadata(rows)
        a, b = fast(logits, metadata), general(logits, _as_general(metadata))
        assert [(r.token_id, r.logprob) for r in a] == [(r.token_id, r.logprob) for r in b]


def test_seeded_rows_draw_once_per_step_from_their_own_generator():
    """Per step, each seeded request advances its generator by exactly one float64 uniform."""
    rows = [_row("a", SamplingParams(temperature=1.0, seed=11)), _row("b", SamplingParams(temperature=1.0)),
            _row("c", SamplingParams(temperature=1.0, seed=12))]
    sampler = Sampler(seed=3)
    metadata = _metadata(rows)
    uniforms = [sampler._uniforms(metadata) for _ in range(3)]  # [3] per step
    own = {rid: torch.Generator().manual_seed(seed) for rid, seed in (("a", 11), ("c", 12))}
    engine = torch.Generator().manual_seed(3)
    for step in uniforms:
        want = [torch.empty(1, dtype=torch.float64).uniform_(generator=own["a"]).item(),
                torch.rand(1, dtype=torch.float64, generator=engine).item(),
                torch.empty(1, dtype=torch.float64).uniform_(generator=own["c"]).item()]
        assert step.tolist() == want
    assert torch.equal(sampler._request_generators["a"].get_state(), own["a"].get_state())
