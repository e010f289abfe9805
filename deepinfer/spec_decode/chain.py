"""The one chain loop of the model drafters (MTP, draft model): after each step, k passes, each
proposing one more token per request, every request packed in one forward per pass.

    pass 0   every request's span: the kept positions without a valid draft row, and the new
             token where it sampled (`ChainDrafter.first_pass`; a request that sampled nothing,
             a prefill chunk, still writes its rows)
    pass j   each chain that still wants drafts: its draft d_j at the next position    (j >= 1)

    chains = first_pass(inputs, samples)
    for j = 0, 1, ...  while chains:
        wanted  = chains with budget > j                      (the others only write rows)
        results = run_pass(j, chains, wanted)                 one forward; per wanted chain its
                                                              argmax and what its next pass carries
        chains  = [chain.next(token, carry) for wanted chains with budget > j + 1]

Drafts are argmax ids (a one-hot proposal q: `draft_probs` is None), so the rejection sampler keeps
the target's distribution exactly. A drafter supplies its pass 0 and its forward (`first_pass`,
`run_pass`); the loop, the budgets and the next spans are here, once.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from deepinfer.contracts.drafting import DraftInputs
from deepinfer.contracts.plan import ScheduledRequest


@dataclass
class Chain:
    """One request's drafting: its next pass (a one-request span over the drafter's groups), how
    many drafts it wants, the drafts so far (the list the step's proposals hold), and what its next
    pass reads besides the token (MTP: the last output streams [1, N, hidden]; None otherwise)."""

    sched: ScheduledRequest
    budget: int
    drafts: list[int]
    carry: Any = None

    @property
    def last_pos(self) -> int:
        return self.sched.start_pos + self.sched.num_tokens - 1

    def next(self, token: int, carry: Any = None) -> Chain:
        """The chain's next pass: `token` at the position after this one, in the same units."""
        s = self.sched
        return Chain(ScheduledRequest(s.request_id, [token], self.last_pos + 1, s.block_ids, s.state_ids),
                     self.budget, self.drafts, carry)


def run_chains(drafter: ChainDrafter, chains: list[Chain]) -> int:
    """The loop (module docstring): passes until no chain wants more drafts. Returns the passes run."""
    step = 0
    while chains:
        wanted = [c for c in chains if c.budget > step]
        results = drafter.run_pass(step, chains, wanted)
        chains = []
        for c, (token, carry) in zip(wanted, results, strict=True):
            c.drafts.append(token)
            if c.budget > step + 1:
                chains.append(c.next(token, carry))
        step += 1
    return step


class ChainDrafter(abc.ABC):
    """A `Drafter` whose passes run a model over the chain loop: every rank runs them (their layers
    split like the target's); the drafts agree. Subclasses give pass 0 and the forward."""

    runs_model = True

    def propose(self, inputs: DraftInputs, samples: dict) -> dict[str, list[int]]:
        chains, drafts = self.first_pass(inputs, samples)
        run_chains(self, chains)
        return drafts

    @abc.abstractmethod
    def first_pass(self, inputs: DraftInputs, samples: dict) -> tuple[list[Chain], dict[str, list[int]]]:
        """Pass 0's chains, and per request that sampled and has room the list its drafts go to."""

    @abc.abstractmethod
    def run_pass(self, step: int, chains: list[Chain], wanted: list[Chain]) -> list[tuple[int, Any]]:
        """One forward over every chain's span, packed; per chain of `wanted` (in order) its argmax
        at its last row and what its next pass carries."""

    def draft_probs(self, request_id: str, draft_token_ids: list[int]):
        return None  # argmax drafts: one-hot q

    def release(self, request_ids: Iterable[str]) -> None:  # noqa: B027 (a hook: nothing kept by default)
        """Nothing kept per request (a subclass that keeps rows' bookkeeping forgets it here)."""
