"""Speculative sampling end to end: on a 32-token model, the tokens sampled through verification
steps follow the exact distribution of plain decoding, computed independently from the HF
transformers model (chi-square, fixed seeds, bound stated below).

Every request decodes 4 tokens from one prompt. After its first token t1 an injected drafter
proposes the 2 most likely continuations (d1 = argmax p(. | t1), d2 = argmax p(. | t1, d1), under
the request's own processed distribution), so the verification step that follows accepts
0, 1 or 2 drafts and then emits a corrected or bonus token: t2 and t3 come from the rejection
sampler, t4 from a bonus draw or a plain step. (max_tokens = 4 rather than 3: with 3, the budget
leaves room to verify only one draft, since the verification step also emits a token of its own.)
"""

from __future__ import annotations

import time

import pytest
import torch
from chi_square import assert_fits, assert_rate
from tiny_models import hf_reference

from deepinfer import LLM, SamplingParams
from deepinfer.spec_decode.drafter import draft_budget

pytestmark = [pytest.mark.parity]

VOCAB = 32
PROMPT = [5, 17, 9, 23, 11, 30, 4]  # ids < 32; EOS (2) is ignored
K = 2
NUM_REQUESTS = 3000

class Reference:
    """The exact law of plain decoding from the HF model: processed distributions of every context
    prompt + (t1, ..) the test needs, with the sampler's stages written out independently."""

    def __init__(self, model_dir: str, params: SamplingParams):
        self.model = hf_reference(model_dir)
        self.params = params

    @torch.no_grad()
    def probs(self, outputs: list[list[int]]) -> torch.Tensor:
        """Per output history h, the processed next-token distribution after PROMPT + h. [n, V] fp64."""
        ids = torch.tensor([PROMPT + h for h in outputs])  # [n, L]: one length, no padding
        logits = self.model(input_ids=ids, use_cache=False).logits[:, -1].double()  # [n, V]
        p = self.params
        for row, h in enumerate(outputs):  # repetition penalty over prompt + outputs (HF / vLLM rule)
            for t in set(PROMPT + h):
                x = logits[row, t]
                logits[row, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        scaled = logits / p.temperature
        kth = scaled.topk(p.top_k, dim=-1).values[:, -1:]  # [n, 1]
        weights = torch.softmax(scaled, dim=-1) * (scaled >= kth)  # [n, V]: top-k kept
        return weights / weights.sum(dim=-1, keepdim=True)

    def laws(self):
        """p(t1) [V], p(t2 | t1) [V, V], p(t3 | t1, t2) [V, V, V], p(t4 | t1, t2, t3) over the
        reachable (top-k) histories: dict (t1, t2, t3) -> [V]."""
        p1 = self.probs([[]])[0]
        p2 = self.probs([[x] for x in range(VOCAB)])  # [V, V]
        p3 = self.probs([[x, y] for x in range(VOCAB) for y in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
        reachable = [[x, y, z] for x in range(VOCAB) if p1[x] > 0 for y in range(VOCAB) if p2[x, y] > 0
                     for z in range(VOCAB) if p3[x, y, z] > 0]
        p4 = dict(zip(map(tuple, reachable), self.probs(reachable).unbind(0), strict=True))
        return p1, p2, p3, p4


class TableDrafter:
    """After a request's first token t, proposes table[t] (cut to the request's budget); nothing
    after later steps. One-hot draft distributions, like the n-gram drafter."""

    runs_model = False  # drafts on rank 0 alone

    def __init__(self, table: dict[int, list[int]]):
        self.table = table

    def propose(self, inputs, samples: dict) -> dict[str, list[int]]:
        drafts = {}
        for s in inputs.sample_rows:
            new = samples.get(s.request_id)
            if new and len(new) == 1 and not s.output_token_ids:  # its first token, just sampled
                drafts[s.request_id] = self.table[new[0].token_id][:draft_budget(s, new, K)]
        return drafts

    def draft_probs(self, request_id: str, draft_token_ids: list[int]):
        return None

    def release(self, request_ids) -> None:
        pass


@pytest.fixture
def one_thread():
    """Tiny matrices: one intra-op thread is faster, and immune to a busy second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    # hidden 512: logits spread enough (std ~1.8) that the most likely token has p ~ 0.13 .. 0.95,
    # so drafts are accepted about half the time (hidden 64 gives p ~ 0.13 everywhere)
    return tiny_checkpoint("llama", vocab_size=VOCAB, hidden_size=512)


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_sampled_tokens_with_drafts_follow_plain_decoding(model_dir, penalty, one_thread):
    started = time.perf_counter()
    params = dict(temperature=0.8, top_k=12, repetition_penalty=penalty, max_tokens=4, ignore_eos=True)
    p1, p2, p3, p4 = Reference(model_dir, SamplingParams(**params)).laws()
    table = {}
    for t in range(VOCAB):
        d1 = int(p2[t].argmax())
        table[t] = [d1, int(p3[t, d1].argmax())]

    llm = LLM(model_dir, speculative_method="ngram", num_speculative_tokens=K, max_num_seqs=64,
              num_blocks=512, block_size=4, max_model_len=64, seed=0)
    llm.engine.runner.steps.drafter = TableDrafter(table)
    seeds = range(int(penalty * 1000), int(penalty * 1000) + NUM_REQUESTS)  # another seed range per case
    outs = llm.generate([PROMPT] * NUM_REQUESTS, [SamplingParams(**params, seed=s) for s in seeds],
                        use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])  # [N, 4]
    assert tokens.shape == (NUM_REQUESTS, 4)

    metrics = llm.get_metrics()
    assert metrics["spec_decode_num_drafts"] == NUM_REQUESTS  # one verification step each
    assert metrics["spec_decode_num_draft_tokens"] == K * NUM_REQUESTS
    accepted = metrics["spec_decode_num_accepted_tokens"]
    assert 0 < accepted < K * NUM_REQUESTS, metrics  # some drafts held, some were rejected
    per_position = metrics["spec_decode_num_accepted_tokens_per_pos"]
    assert 0 < per_position[1] < per_position[0] < NUM_REQUESTS, metrics  # both positions both ways
    llm.engine.kv_manager.check_no_leaks()

    # the accepted drafts are the tokens the drafter proposed, so the acceptance of d1 is a binomial
    # count with success probability sum_t p1(t) p2(d1(t) | t) (one-hot q: accept with p(d1))
    accept_d1 = float(sum(p1[t] * p2[t, table[t][0]] for t in range(VOCAB)))
    assert_rate(per_position[0], NUM_REQUESTS, accept_d1, "first draft accepted")

    # the exact laws of each output token, marginalised over the earlier ones
    law2 = (p1[:, None] * p2).sum(0)  # [V]
    joint23 = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [V, V]
    law3 = joint23.sum(0)
    law4 = torch.zeros(VOCAB, dtype=torch.float64)
    for (x, y, z), p in p4.items():
        law4 += p1[x] * p2[x, y] * p3[x, y, z] * p
    t1, t2, t3, t4 = tokens.unbind(1)
    assert_fits(torch.bincount(t1, minlength=VOCAB), p1, "token 1 (plain sampling: checks the reference)")
    assert_fits(torch.bincount(t2, minlength=VOCAB), law2, "token 2")
    assert_fits(torch.bincount(t1 * VOCAB + t2, minlength=VOCAB * VOCAB), p1[:, None] * p2, "tokens 1 and 2")
    assert_fits(torch.bincount(t3, minlength=VOCAB), law3, "token 3")
    assert_fits(torch.bincount(t2 * VOCAB + t3, minlength=VOCAB * VOCAB), joint23, "tokens 2 and 3")
    assert_fits(torch.bincount(t4, minlength=VOCAB), law4, "token 4")
    # given the first token, the second: the most frequent t1 has enough draws for its own test
    top = int(torch.bincount(t1, minlength=VOCAB).argmax())
    assert_fits(torch.bincount(t2[t1 == top], minlength=VOCAB), p2[top], f"token 2 after token 1 = {top}")
    print(f"\n{penalty=}: accepted {per_position} of {NUM_REQUESTS} x {K}, "
          f"{time.perf_counter() - started:.1f} s")
