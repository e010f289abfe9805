"""A multi-query decode step (k+1 positions of one request, stored then read, as verification
will use) gives the same logits as a plain prefill of those positions, across a wrapped ring."""

from __future__ import annotations

import random

import torch
from tiny_models import run_steps

from deepinfer import LLM
from deepinfer.contracts.plan import ScheduledRequest


def test_verification_step_equals_prefill(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("gemma3"), num_blocks=32, block_size=8, max_model_len=256, max_num_seqs=2)
    ring = next(g for g in llm.engine.runner.groups if g.kind == "ring")
    assert ring.window == 16 and ring.rows_per_unit == 22  # S = W + 6 >= W + k + 1 for k = 5
    rng = random.Random(0)
    tokens = [rng.randrange(3, 49152) for _ in range(70)]  # the ring wraps three times
    table, p, k = list(range(9)), 61, 5
    prefill = ScheduledRequest("r", tokens[:p], 0, (table,), (0,))
    verify = ScheduledRequest("r", tokens[p:p + k + 1], p, (table,), (0,), verify=True)
    _, got = run_steps(llm, [prefill, verify])  # [k+1, V] from the decode path
    fresh = list(range(9, 18))  # other blocks and another state slot: nothing shared with the first run
    ref = run_steps(llm, [ScheduledRequest("q", tokens[:p + k + 1], 0, (fresh,), (1,))])[0][p:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
