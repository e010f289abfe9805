"""What a step changes that a re-run of it reads, saved before the step and put back if it raises.

The engine finds the culprit of a failed step by running its requests again one at a time
(`engine/llm_engine.py`). A re-run computes the same values into the same places, so most of what
the failed step wrote needs no undo: paged rows (token rows, compressed rows, index keys) and the
ring row of each new token are written again, identically, before anything reads them. Two things
the step changed are read by its own re-run, and the runner puts them back:

    per-request state beside the caches      the model's record: `CachedModel.begin_step` /
                                             `undo_step` (DeepSeek-V4: every compressor's token
                                             count, open window and half A)
    ring rows a chunk loads, then overwrites  a chunk of n tokens at p reads the rows of its window
                                             before it, p-W+1 .. p-1, then stores p .. p+n-1 at row
                                             (pos mod S): positions p-W+1 .. p+n-1-S lose their
                                             rows (`overwritten_window`). Saved for every ring
                                             group, all its layers, before the step

A decode token (n = 1) or a verification step (n = 1 + k, S >= W + k + 1) overwrites no row its
window reads: plain decode steps save nothing here, and the model's record is a few counts (plus
half A of the CSA windows they complete). Prefill chunks save at most W - 1 rows per ring layer
and the open window of each compressor.

With several tensor-parallel ranks a failed step is fatal (the ranks are out of step), so only the
one-rank `ModelRunner.execute` undoes; every rank records alike.
"""

from __future__ import annotations

import torch

from deepinfer.contracts.plan import StepPlan
from deepinfer.model_executor.layers.ops.addressing import ring_slot


def overwritten_window(start: int, num_tokens: int, window: int, ring_rows: int) -> range:
    """Positions whose ring rows a chunk of `num_tokens` tokens at `start` both reads (its window
    before it: start-W+1 .. start-1) and overwrites (it stores start .. start+n-1 at row pos mod S,
    S = `ring_rows` > W: a row of position x is overwritten when x + S <= start + n - 1)."""
    return range(max(0, start - window + 1), min(start, start + num_tokens - ring_rows))


class StepUndo:
    """`begin(plan)` before a step's cache copies and forward; `undo()` after it raised."""

    def __init__(self, cache, model):
        self.cache, self.model = cache, model  # CacheEngine, CachedModel
        self.rings = [gi for gi, g in enumerate(cache.groups) if g.is_ring]  # in state_ids order
        self._saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (unit rows, row ids, bytes)
        self.num_rows_saved = 0  # ring rows saved since start (all layers of a group count once)

    def begin(self, plan: StepPlan) -> None:
        """Forget the last step's saves; save the ring rows this plan's chunks load and overwrite,
        and start the model's record."""
        self._saved = []
        self.model.begin_step()
        for s in plan.scheduled:
            for ri, gi in enumerate(self.rings):
                group = self.cache.groups[gi]
                lost = overwritten_window(s.start_pos, s.num_tokens, group.window, group.rows_per_unit)
                if lost:
                    self._save(gi, s.state_ids[ri], lost)

    def _save(self, gi: int, unit: int, positions: range) -> None:
        """Copy the rows of `positions` in ring unit `unit` of group gi, every layer's."""
        group = self.cache.groups[gi]
        unit_rows = self.cache.allocations[gi][unit].view(len(group.layer_ids), group.rows_per_unit, -1)
        # [layers, S, row bytes]: a view of the allocation
        pos = torch.arange(positions.start, positions.stop, device=unit_rows.device)  # [r]
        index = ring_slot(0, pos, group.rows_per_unit)  # [r] rows within the unit
        self._saved.append((unit_rows, index, unit_rows[:, index]))  # [layers, r, row bytes] copied
        self.num_rows_saved += len(positions)

    def undo(self) -> None:
        """Put back the saved ring rows and the model's per-request state; nothing is saved after."""
        for unit_rows, index, saved in reversed(self._saved):
            unit_rows[:, index] = saved
        self._saved = []
        self.model.undo_step()
