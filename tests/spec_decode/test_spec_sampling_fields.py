"""Verification applies logit_bias, min_tokens and bad_words per verified position, as plain
decoding would at that position: greedy acceptance on hand-made logits, and speculative sampling
against an exact law written out independently (chi-square), both with bans that depend on the
drafts before each row."""

from __future__ import annotations

import pytest
import torch
from chi_square import assert_fits
from test_rejection import TRIALS, P, V, _logits, _row, _simulate, _tokens

from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode.rejection import RejectionSampler

pytestmark = [pytest.mark.parity]

EOS = 1


def _params(**fields) -> SamplingParams:
    """Params as the engine hands them over: EOS set, bad words already tokenized (ids given)."""
    bad = fields.pop("bad_ids", ())
    params = SamplingParams(**fields)
    params.set_eos_token_ids([EOS])
    params._bad_words_token_ids = tuple(tuple(w) for w in bad)
    return params


def reference_probs(row: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """Plain decoding's law at one position, written out: + bias, EOS / stop ids out while fewer
    than min_tokens outputs exist, a bad word's last token out after its other tokens, then
    softmax at the temperature (greedy: one-hot at the argmax). [V] fp64."""
    x = row.double().clone()
    for t, b in params.logit_bias.items():
        x[t] += b
    if len(output) < params.min_tokens:
        x[[EOS, *params.stop_token_ids]] = float("-inf")
    for word in params._bad_words_token_ids:
        if len(word) == 1 or output[-(len(word) - 1):] == list(word[:-1]):
            x[word[-1]] = float("-inf")
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    return torch.softmax(x / params.temperature, dim=-1)


def test_greedy_min_tokens_depends_on_the_draft_position():
    logits = torch.zeros(3, V)
    logits[:, EOS] = 5.0  # EOS is every row's raw argmax
    logits[:, 4] = 3.0
    rs = RejectionSampler(Sampler())
    params = _params(temperature=0.0, min_tokens=2, max_tokens=8)
    # output [] : row 0 (0 outputs) and row 1 (1 output) mask EOS; row 2 (2 outputs) does not
    assert _tokens(rs(logits, [_row("a", params, [4, 4])])) == [[4, 4, EOS]]
    # a drafted EOS at the first position is rejected there; the target's token replaces it
    assert _tokens(rs(logits, [_row("b", params, [EOS, 4])])) == [[4]]
    # after one output, the second draft position (2 outputs) may be EOS
    assert _tokens(rs(logits, [_row("c", params, [4, EOS], output=[9])])) == [[4, EOS, EOS]]


def test_greedy_bad_word_depends_on_the_drafts_before_the_row():
    logits = torch.zeros(3, V)
    logits[0, 4], logits[0, 5] = 6.0, 5.0
    logits[1, 5], logits[1, 4] = 6.0, 5.0  # the bad word (4, 5)'s last token is row 1's raw argmax
    logits[2, 5], logits[2, 2] = 6.0, 5.0
    rs = RejectionSampler(Sampler())
    params = _params(temperature=0.0, bad_ids=[(4, 5)])
    assert _tokens(rs(logits, [_row("a", params, [4, 5])])) == [[4, 4]]  # drafted 4, 5 is refused
    assert _tokens(rs(logits, [_row("b", params, [4, 4])])) == [[4, 4, 2]]
    assert _tokens(rs(logits, [_row("c", params, [4, 5], output=[4])])) == [[4, 4]]
    assert _tokens(rs(logits[1:], [_row("d", params, [5], output=[3])])) == [[5, 5]]  # no 4 before: allowed


def test_greedy_logit_bias_moves_the_argmax_of_every_row():
    logits = _logits(3, V, seed=1)
    rs = RejectionSampler(Sampler())
    params = _params(temperature=0.0, logit_bias={6: 100})
    assert _tokens(rs(logits, [_row("a", params, [6, 6])])) == [[6, 6, 6]]
    assert _tokens(rs(logits, [_row("b", params, [0, 6])])) == [[6]]


@pytest.mark.parametrize("proposer", ["one_hot", "general_q"])
def test_speculative_sampling_with_fields_keeps_the_law(proposer):
    logits = _logits(1, V, seed=8, scale=1.0).expand(P, V).clone()  # [P, V]
    logits[:, EOS] += 1.5  # EOS likely, so min_tokens matters
    params = _params(temperature=0.9, min_tokens=2, logit_bias={3: 1.0, 0: -2.0}, bad_ids=[(3, 4), (7,)],
                     max_tokens=8)
    p0 = reference_probs(logits[0], params, [])
    joint = torch.stack([p0[x] * reference_probs(logits[1], params, [x]) for x in range(V)])  # [V, V]
    third = sum(joint[x, y] * reference_probs(logits[2], params, [x, y])
                for x in range(V) for y in range(V) if joint[x, y] > 0)  # [V]
    generator = torch.Generator().manual_seed(23)
    if proposer == "one_hot":
        q, law = None, torch.full((P, V), 1.0 / V)  # uniform drafts, banned tokens included
    else:
        q = torch.softmax(_logits(P, V, seed=9, scale=1.5), dim=-1)  # [P, V]
        law = q
    drafts = torch.stack([torch.multinomial(law[j], TRIALS * P, replacement=True, generator=generator)
                          .view(TRIALS, P) for j in range(P)], dim=-1)  # [trial, step, position]
    tokens, _ = _simulate(RejectionSampler(Sampler(seed=5)), logits, params, [], drafts, q)
    assert_fits(torch.bincount(tokens[:, 0], minlength=V), p0, f"{proposer}: token 1")
    assert_fits(torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V), joint, f"{proposer}: 1 and 2")
    assert_fits(torch.bincount(tokens[:, 2], minlength=V), third, f"{proposer}: token 3")
    assert not (tokens[:, :2] == EOS).any() and not (tokens == 7).any()
    assert not ((tokens[:, :-1] == 3) & (tokens[:, 1:] == 4)).any()
