"""RejectionSampler on hand-made logits (no model): greedy acceptance with penalties that move with
the drafts, exactness of speculative sampling (chi-square against the target distribution, for
one-hot and general draft distributions), seeds, and logprobs."""

from __future__ import annotations

import pytest
import torch
from chi_square import assert_fits, assert_rate

from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec_decode.rejection import RejectionSampler, VerifyRow

pytestmark = [pytest.mark.parity]

# ---- an independent reference of the target distribution -----------------------------------------


def target_probs(logits_row: torch.Tensor, params: SamplingParams, prompt: list[int],
                 output: list[int]) -> torch.Tensor:
    """What plain decoding samples from, written out with a full sort: repetition penalty over
    prompt + outputs, presence penalty over outputs, temperature, top-k, then top-p over the
    renormalized top-k (greedy: one-hot at the argmax). [V] fp64."""
    x = logits_row.double().clone()
    for t in set(prompt + output):
        x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.presence_penalty
    if params.greedy:
        return torch.nn.functional.one_hot(x.argmax(), x.numel()).double()
    p = torch.softmax(x / params.temperature, dim=-1)
    order = p.argsort(descending=True)
    k = params.top_k if params.top_k > 0 else x.numel()
    top = p[order[:k]] / p[order[:k]].sum()
    before = top.cumsum(0) - top  # mass of the better tokens
    kept = order[:k][before < params.top_p]
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


# ---- helpers -------------------------------------------------------------------------------------


def _row(request_id: str, params: SamplingParams, drafts: list[int], prompt=(), output=(),
         q: torch.Tensor | None = None) -> VerifyRow:
    return VerifyRow(request_id, params, list(prompt), list(output), list(drafts), q)


def _tokens(results) -> list[list[int]]:
    return [[r.token_id for r in row] for row in results]


def _logits(num_rows: int, vocab_size: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def _advanced(seed: int, draws: int) -> torch.Tensor:
    """The state of a request generator of `seed` after `draws` single uniforms (Sampler.uniform)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(draws):
        torch.empty(1, dtype=torch.float64).uniform_(generator=g)
    return g.get_state()


GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def one_thread():
    """[n, 8] tensors: one intra-op thread is faster, and immune to a busy second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- greedy --------------------------------------------------------------------------------------


def test_greedy_accepts_the_argmax_prefix_then_the_targets_token():
    logits = torch.full((4, 6), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 1] = logits[3, 5] = 3.0  # argmax per row: 2, 4, 1, 5
    rs = RejectionSampler(Sampler())
    cases = {
        (2, 4, 1): [2, 4, 1, 5],  # all held: the bonus of row k
        (2, 4, 0): [2, 4, 1],  # first miss at draft 3: row 2's argmax
        (2, 3, 1): [2, 4],  # miss at draft 2; draft 3 would match but is never looked at
        (0, 4, 1): [2],  # miss at draft 1
    }
    for drafts, want in cases.items():
        assert _tokens(rs(logits, [_row("g", GREEDY, drafts)])) == [want], drafts
    # a shorter draft list uses only its own rows, in a batch with others
    batch = [_row("a", GREEDY, [2, 4, 1]), _row("b", GREEDY, [2]), _row("c", GREEDY, [])]
    both = torch.cat([logits, logits[:2], logits[:1]])  # [4 + 2 + 1, V]
    assert _tokens(rs(both, batch)) == [[2, 4, 1, 5], [2, 4], [2]]


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=2.0), dict(presence_penalty=1.5)])
def test_greedy_penalties_count_the_drafts_before_each_row(penalty):
    """Row i is penalized as if drafts 1..i were outputs: the raw argmax of rows 1..3 (0, 0, 3) is a
    token drafted before the row, the penalized one moves on (1, 3, 4)."""
    v = 6
    logits = torch.zeros(4, v)
    logits[0, [0, 1, 2]] = torch.tensor([3.0, 1.0, 0.5])  # argmax 0
    logits[1, [0, 1, 2]] = torch.tensor([3.0, 2.0, 0.5])  # raw 0; 0 penalized -> 1
    logits[2, [0, 1, 3]] = torch.tensor([2.9, 2.8, 1.5])  # raw 0; 0 and 1 penalized -> 3
    logits[3, [0, 3, 4]] = torch.tensor([2.5, 3.0, 2.0])  # raw 3; 0, 1 and 3 penalized -> 4
    params = SamplingParams(temperature=0.0, **penalty)
    rs = RejectionSampler(Sampler())
    got = _tokens(rs(logits, [_row("r", params, [0, 1, 3], prompt=[5])]))
    assert got == [[0, 1, 3, 4]]
    # each row is what plain greedy decoding would pick with drafts 1..i as its outputs
    for i, token in enumerate(got[0]):
        assert int(target_probs(logits[i], params, [5], got[0][:i]).argmax()) == token
        plain = Sampler()(logits[i:i + 1], _plain_metadata(params, [5], got[0][:i]))
        assert plain[0].token_id == token
    # a draft that is the raw argmax but not the penalized one is rejected for the penalized one
    assert _tokens(rs(logits, [_row("r", params, [0, 0, 0], prompt=[5])])) == [[0, 1]]
    # outputs before the step count as well: with 0 already an output, row 1's logits pick 1, then 3
    assert _tokens(rs(logits[1:3], [_row("r", params, [1], prompt=[5], output=[0])])) == [[1, 3]]


def _plain_metadata(params, prompt, output):
    from deepinfer.model_executor.layers.sampling_metadata import SamplingMetadata

    return SamplingMetadata.from_rows(["p"], [params], [list(prompt)], [list(output)], "cpu")


# ---- exactness of speculative sampling -----------------------------------------------------------

V, P, K, TRIALS = 8, 3, 2, 10000  # vocabulary, tokens per trial, drafts per step, trials


def _simulate(sampler: RejectionSampler, logits: torch.Tensor, params: SamplingParams, prompt: list[int],
              drafts: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
    """Decode P tokens per trial through verification steps of up to K drafts.

    The target at absolute position j is logits[j], penalized by the trial's history, so the exact
    law of the P tokens is p_0(x) p_1(y | x) p_2(z | x, y). A step at position j verifies the
    drafts for positions j .. j + k' - 1 (k' = min(K, P - 1 - j)) against rows logits[j .. j + k'];
    drafts[t, s, j] is trial t's draft for position j at its step s, drawn by the test from the
    proposer's law at j (q[j], or anything independent of the target for a one-hot q = None).
    -> tokens [TRIALS, P], and the number of tokens each trial's first step emitted.
    """
    num_trials = drafts.shape[0]
    tokens: list[list[int]] = [[] for _ in range(num_trials)]
    first_step: list[int] = []
    pending, step = list(range(num_trials)), 0
    while pending:
        rows, chunks = [], []
        for t in pending:
            j = len(tokens[t])
            k = min(K, P - 1 - j)
            rows.append(_row(f"t{t}", params, drafts[t, step, j:j + k].tolist(), prompt, tokens[t],
                             None if q is None else q[j:j + k]))
            chunks.append(logits[j:j + k + 1])
        results = _tokens(sampler(torch.cat(chunks), rows))
        for t, got in zip(pending, results, strict=True):
            assert 1 <= len(got) <= P - len(tokens[t])
            tokens[t] = tokens[t] + got
        if step == 0:
            first_step = [len(got) for got in results]
        pending, step = [t for t in pending if len(tokens[t]) < P], step + 1
    return torch.tensor(tokens), first_step


def _exact_law(logits: torch.Tensor, params: SamplingParams, prompt: list[int]):
    """p_0 [V], the joint of the first two tokens [V, V], the law of the third [V] (all fp64)."""
    p0 = target_probs(logits[0], params, prompt, [])
    joint = torch.stack([p0[x] * target_probs(logits[1], params, prompt, [x]) for x in range(V)])  # [V, V]
    third = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        for y in range(V):
            if joint[x, y] > 0:
                third += joint[x, y] * target_probs(logits[2], params, prompt, [x, y])
    return p0, joint, third


ROWS = {  # name -> (target logits [P, V], params, prompt)
    "distinct_rows": (_logits(P, V, seed=3, scale=1.0), SamplingParams(temperature=0.8, top_k=6, top_p=0.9), []),
    "same_rows": (_logits(1, V, seed=2).expand(P, V), SamplingParams(temperature=0.8, top_k=6, top_p=0.9), []),
    # identical logits, but the penalty makes p_1(y | x) depend on x (and p_2 on x, y)
    "same_rows_penalized": (_logits(1, V, seed=3).abs().expand(P, V),
                            SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.8), [7]),
}


@pytest.mark.parametrize("case, proposer", [("distinct_rows", "one_hot"), ("distinct_rows", "general_q"),
                                            ("same_rows", "one_hot"), ("same_rows_penalized", "general_q")])
def test_speculative_sampling_emits_the_target_distribution(case, proposer):
    logits, params, prompt = ROWS[case]
    p0, joint, third = _exact_law(logits, params, prompt)
    generator = torch.Generator().manual_seed(17)
    if proposer == "one_hot":
        # drafts: half the time the raw argmax at the position, else uniform; q = None (one-hot)
        q = None
        law = torch.full((P, V), 0.5 / V)
        law[torch.arange(P), logits.argmax(dim=-1)] += 0.5  # [P, V]
    else:
        # a proposer that misses some tokens the target keeps (q = 0) and puts mass on tokens the
        # target filters (p = 0): rejection must redistribute mass both ways
        q = torch.softmax(_logits(P, V, seed=4, scale=1.5), dim=-1)  # [P, V]
        q[:, 0] = 0.0
        q = q / q.sum(dim=-1, keepdim=True)
        law = q
    drafts = torch.stack([torch.multinomial(law[j], TRIALS * P, replacement=True, generator=generator)
                          .view(TRIALS, P) for j in range(P)], dim=-1)  # [trial, step, position] ~ law[position]
    tokens, first_step = _simulate(RejectionSampler(Sampler(seed=5)), logits, params, prompt, drafts, q)

    assert_fits(torch.bincount(tokens[:, 0], minlength=V), p0, f"{case}/{proposer}: token 1")
    pairs = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    assert_fits(pairs, joint, f"{case}/{proposer}: tokens 1 and 2")
    assert_fits(torch.bincount(tokens[:, 2], minlength=V), third, f"{case}/{proposer}: token 3")

    # the first draft is accepted with probability sum_x law(x) min(1, p(x) / q(x))
    ratio = p0 if q is None else torch.where(q[0] > 0, p0 / q[0].double(), torch.ones_like(p0))
    accept = float((law[0].double() * ratio.clamp(max=1.0)).sum())
    first_accepted = sum(n >= 2 for n in first_step)
    assert_rate(first_accepted, TRIALS, accept, f"{case}/{proposer}: first draft accepted")
    assert 0 < first_step.count(1) and 0 < first_step.count(P), "both rejections and full acceptances happen"


def test_a_draft_the_target_filters_is_never_accepted():
    logits = _logits(2, V, seed=6)
    params = SamplingParams(temperature=1.0, top_k=2)
    filtered = int(logits[0].argmin())
    rs = RejectionSampler(Sampler(seed=0))
    q = torch.zeros(1, V)
    q[0, filtered] = 1.0
    n = 3000
    for probs in (None, q):
        rows = [_row(f"r{i}", params, [filtered], q=probs) for i in range(n)]
        got = _tokens(rs(logits.repeat(n, 1), rows))
        assert all(len(t) == 1 for t in got)
        counts = torch.bincount(torch.tensor([t[0] for t in got]), minlength=V)
        assert_fits(counts, target_probs(logits[0], params, [], []), "after a filtered draft")


# ---- seeds ---------------------------------------------------------------------------------------


def _mixed_batch(seeded: VerifyRow, seeded_logits: torch.Tensor, where: int, step: int):
    """`seeded` among other rows: unseeded, greedy, another seeded one and a general-q one, whose
    drafts change from step to step (so their acceptances, and draws, do too)."""
    others, chunks = [], []
    for i, params in enumerate([SamplingParams(temperature=1.0), GREEDY, SamplingParams(temperature=0.7, seed=5),
                                SamplingParams(temperature=1.2, top_p=0.8)]):
        k = 1 + (i + step) % 3
        drafts = [(step * 3 + i + j) % V for j in range(k)]
        q = torch.softmax(_logits(k, V, seed=100 + step), dim=-1) if i == 3 else None
        others.append(_row(f"o{i}", params, drafts, q=q))
        chunks.append(_logits(k + 1, V, seed=200 + 10 * step + i))
    others.insert(where, seeded)
    chunks.insert(where, seeded_logits)
    return torch.cat(chunks), others


def test_a_seeded_request_draws_the_same_tokens_in_any_batch():
    logits = _logits(4, V, seed=7, scale=1.0)  # flat enough that acceptances vary
    alone, crowded, other_seed = RejectionSampler(Sampler(seed=0)), RejectionSampler(Sampler(seed=99)), \
        RejectionSampler(Sampler(seed=0))
    runs: dict[str, list] = {"alone": [], "crowded": [], "other_seed": []}
    for step in range(40):
        drafts = [step % V, (step * 5) % V, 3]
        row = _row("x", SamplingParams(temperature=1.0, seed=1234), drafts)
        runs["alone"].append(_tokens(alone(logits, [row]))[0])
        batch_logits, batch = _mixed_batch(row, logits, where=step % 5, step=step)
        runs["crowded"].append(_tokens(crowded(batch_logits, batch))[step % 5])
        row2 = _row("x", SamplingParams(temperature=1.0, seed=4321), drafts)
        runs["other_seed"].append(_tokens(other_seed(logits, [row2]))[0])
    assert runs["alone"] == runs["crowded"]
    assert runs["alone"] != runs["other_seed"]  # the seed matters
    assert len({len(t) for t in runs["alone"]}) > 1  # acceptances varied along the way


def test_a_seeded_request_draws_one_uniform_per_checked_draft_plus_one():
    """Its generator advances by (drafts checked) + 1 -- a + 2 after a rejection at draft a + 1, k + 1
    when all k held -- whatever the other rows of the batch did; seeded rows leave the engine
    generator alone, and greedy rows draw nothing."""
    logits = _logits(4, V, seed=8, scale=1.0)
    sampler = Sampler(seed=0)
    rs = RejectionSampler(sampler)
    k, draws, lengths = 3, 0, set()
    for step in range(40):
        q = torch.softmax(_logits(k, V, seed=300 + step), dim=-1) if step % 2 else None
        row = _row("x", SamplingParams(temperature=1.0, seed=77), [step % V, 2, 5], q=q)
        batch_logits, batch = _mixed_batch(row, logits, where=step % 5, step=step)
        got = _tokens(rs(batch_logits, batch))[step % 5]
        accepted = len(got) - 1
        draws += accepted + 2 if accepted < k else k + 1
        lengths.add(len(got))
        state = sampler.save_generators(["x"]).request_states["x"]
        assert torch.equal(state, _advanced(77, draws)), (step, got)
    assert len(lengths) > 1

    only_seeded = RejectionSampler(Sampler(seed=0))
    engine_before = only_seeded.sampler.save_generators([]).engine_state
    only_seeded(logits, [_row("s", SamplingParams(temperature=1.0, seed=1), [1, 2, 3])])
    assert torch.equal(only_seeded.sampler.save_generators([]).engine_state, engine_before)

    greedy_only = RejectionSampler(Sampler(seed=0))
    greedy_only(logits, [_row("g", SamplingParams(temperature=0.0, seed=3), [1, 2, 3])])
    assert greedy_only.sampler.num_request_generators == 0
    assert torch.equal(greedy_only.sampler.save_generators([]).engine_state, engine_before)


# ---- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_the_raw_log_softmax_of_each_row():
    v = 10
    logits = _logits(4 + 3 + 2 + 1, v, seed=9)
    params = [SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.5, top_k=4, logprobs=0, seed=1, repetition_penalty=1.3),
              SamplingParams(temperature=1.5, logprobs=5, seed=2),
              SamplingParams(temperature=0.9, seed=3)]
    greedy_drafts = [int(t) for t in logits[0:3].argmax(dim=-1)]  # all held: 4 tokens
    rows = [_row("g", params[0], greedy_drafts, prompt=[1, 2]),
            _row("s", params[1], [4, 5], prompt=[4]),
            _row("t", params[2], [int(logits[7].argmax())]),
            _row("u", params[3], [])]
    results = RejectionSampler(Sampler(seed=0))(logits, rows)
    assert len(results[0]) == 4
    reference = torch.log_softmax(logits, dim=-1)  # [M, V]: raw, before penalties or temperature
    first = 0
    for row, result in zip(rows, results, strict=True):
        for i, r in enumerate(result):
            assert r.logprob == pytest.approx(float(reference[first + i, r.token_id]), abs=1e-5)
            n = row.params.logprobs
            if n is None:
                assert r.top_logprobs is None
            else:
                values, ids = reference[first + i].topk(n) if n else (torch.empty(0), torch.empty(0))
                assert [t for t, _ in r.top_logprobs] == ids.tolist()
                assert [lp for _, lp in r.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)
        first += row.num_rows


def test_logits_of_the_wrong_shape_are_refused():
    rs = RejectionSampler(Sampler())
    with pytest.raises(ValueError, match="M = 3"):
        rs(torch.zeros(2, V), [_row("a", GREEDY, [1, 2])])
    with pytest.raises(ValueError):
        rs(torch.zeros(3), [_row("a", GREEDY, [1, 2])])
