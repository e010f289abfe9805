"""How many drafts a request is worth after a step: k (`--speculative-draft-length fixed`), or as many as
pay for themselves by the request's own running acceptance (`adaptive`, the default).

A step that verifies k drafts yields E(k) tokens and costs C(k) plain decode steps:

    E(k) = 1 + a + a^2 + ... + a^k              a: the chance that a draft is accepted given that the
                                                   ones before it were (geometric: one rejection ends a run)
    C(k) = 1 + sunk + k * row + max(k - 1, 0) * draft

    draft   one draft pass, as a share of a decode step: the draft checkpoint's weight bytes over
            the target's (decode reads every weight once a token), the MTP layers' share of the
            model's layers, 0 for n-gram; the same on every rank of a split model, so that every
            rank drafts alike
    sunk    a pass that runs whatever k is: a model drafter's pass 0 writes the rows of the tokens
            the step kept (so the draft's cache follows the target's) and gives d_1 on the way
    row     one more row in the verification, as a share of a decode step (`row_cost`): decode is
            bound by reading the weights, which every row shares, so a row costs its arithmetic only

The budget is the k in 0 .. cap (cap: draft_budget's, k at most) with the most tokens per cost,
E(k) / C(k) (the smallest such k on ties). `a` is each request's own: accepted / (accepted +
rejected) over its verifications, each step's counts added to the earlier ones decayed by
`DECAY`, starting from a prior of PRIOR (0.8: draft at first). A request whose budget fell to 0
still verifies one draft every PROBE_EVERY steps, so that its estimate can rise again.

Everything here depends on the request's own history and fixed costs, never on timing or on the
batch: the number of draws a seeded request makes stays its own (docs: "Speculative decoding").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from deepinfer.contracts.plan import ScheduledRequest

DECAY = 0.8  # weight of a request's earlier counts at each verification
PRIOR = (4.0, 1.0)  # (accepted, rejected) before the first verification: a = 0.8
PROBE_EVERY = 8  # steps between single-draft probes of a request whose budget is 0


def tokens_per_cost(a: float, k: int, draft: float, row: float, sunk: float) -> float:
    """E(k) / C(k) of the module docstring."""
    expected = sum(a ** j for j in range(k + 1))
    cost = 1.0 + sunk + k * row + max(k - 1, 0) * draft
    return expected / cost


def best_length(a: float, cap: int, draft: float, row: float, sunk: float) -> int:
    """The k in 0 .. cap with the most tokens per cost (the smallest on ties)."""
    return max(range(cap + 1), key=lambda k: (tokens_per_cost(a, k, draft, row, sunk), -k))


@dataclass
class _Record:
    accepted: float = PRIOR[0]
    rejected: float = PRIOR[1]
    steps: int = 0  # steps since the budget was last above 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class DraftLength:
    """Per request: its running acceptance and the budget it earns (module docstring). A drafter
    asks `budget(s, new, cap)` once per request and step, before drafting."""

    def __init__(self, adaptive: bool, draft_cost: float, row_cost: float, sunk: bool):
        self.adaptive = adaptive
        self.draft, self.row = float(draft_cost), float(row_cost)
        self.sunk = self.draft if sunk else 0.0
        self._records: dict[str, _Record] = {}

    def budget(self, s: ScheduledRequest, new: list, cap: int) -> int:
        """Drafts request s gets after this step (`new`: its samples), at most `cap`."""
        if not self.adaptive or cap <= 0:
            return cap
        record = self._records.setdefault(s.request_id, _Record())
        if s.verify and new:  # the step verified len(tokens) - 1 drafts and kept len(new) - 1 of them
            proposed, accepted = s.num_tokens - 1, len(new) - 1
            record.accepted = DECAY * record.accepted + accepted
            record.rejected = DECAY * record.rejected + (1.0 if accepted < proposed else 0.0)
        k = best_length(record.rate, cap, self.draft, self.row, self.sunk)
        record.steps = 0 if k else record.steps + 1
        if k == 0 and record.steps % PROBE_EVERY == 0:
            return 1
        return k

    def acceptance(self, request_id: str) -> float | None:
        """The request's running acceptance (None: not seen)."""
        record = self._records.get(request_id)
        return None if record is None else record.rate

    def release(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._records.pop(request_id, None)
