"""Per-request compressor state, kept in the request's state slot (fixed shapes, fp32).

A `StateBank` holds one `CompressorState` per state slot of the ring group: the open window's
kv and scores, CSA's half A of the last complete window, and the token count. A request that
starts over (position 0: a new request, or one recomputed after preemption) gets a fresh state;
any other start must continue exactly where the slot's state ended.

Undo of a failed step: between `begin_step` and `undo_step` the bank records, before each change,
the part of a slot's state that the change makes different and that a re-run of the step reads:
the token count always; for a span's `write`, the open window's valid rows (``[0, n mod m)``) and
CSA's half A; for a batch of decode tokens, half A of the windows they complete (the row a decode
token fills was not valid before it). `undo_step` puts them back, newest first, so every slot is
as the step found it and the step can run again. `load` (the cache copies before a step) is not
recorded: a re-run of the step copies again.
"""

from __future__ import annotations

import torch

from deepinfer.model_executor.models.deepseek_v4.compressor import CompressorState


class StateBank:
    def __init__(self, initial: CompressorState, num_slots: int):
        self.initial = initial
        self.kv = initial.kv.expand(num_slots, -1, -1).clone()  # [slots, m, C]
        self.score = initial.score.expand(num_slots, -1, -1).clone()  # [slots, m, C]
        self.prev_a_kv = initial.prev_a_kv.expand(num_slots, -1, -1).clone()  # [slots, m | 0, D]
        self.prev_a_score = initial.prev_a_score.expand(num_slots, -1, -1).clone()  # [slots, m | 0, D]
        self.num_tokens = [0] * num_slots
        self._undo: list | None = None  # this step's undo records (None: not recording)

    @staticmethod
    def bytes_per_slot(initial: CompressorState) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (initial.kv, initial.score, initial.prev_a_kv, initial.prev_a_score))

    def read(self, slot: int, start_pos: int) -> CompressorState:
        if start_pos == 0:
            return self.initial
        if self.num_tokens[slot] != start_pos:
            raise RuntimeError(f"state slot {slot} holds {self.num_tokens[slot]} tokens, "
                               f"but the request continues at position {start_pos}")
        return CompressorState(self.kv[slot], self.score[slot], self.prev_a_kv[slot], self.prev_a_score[slot],
                               self.num_tokens[slot])

    def step_tokens(self, compressor, slot_ids: list[int], positions: list[int], kv: torch.Tensor,
                    score: torch.Tensor):
        """One new token for each of several requests at once (decode): kv, score [N, C] of the
        tokens at `positions` in state slots `slot_ids`. Returns (rows [r, D], which [r]: the
        requests whose window the token completes, row_ids [r]); their half A moves on (CSA)."""
        m = compressor.compress_rate
        for slot, pos in zip(slot_ids, positions, strict=True):
            if self.num_tokens[slot] != pos:
                raise RuntimeError(f"state slot {slot} holds {self.num_tokens[slot]} tokens, "
                                   f"but the request continues at position {pos}")
        self._save_counts(slot_ids)
        for slot, pos in zip(slot_ids, positions, strict=True):
            self.num_tokens[slot] = pos + 1
        slots = torch.tensor(slot_ids, device=kv.device)  # [N]
        pos = torch.tensor(positions, device=kv.device)  # [N]
        self.kv[slots, pos % m], self.score[slots, pos % m] = kv, score  # the token's place in its window
        which = torch.nonzero((pos + 1) % m == 0).flatten()  # [r]
        done = slots[which]  # [r]
        win_kv, win_score = self.kv[done], self.score[done]  # [r, m, C]
        pooled = compressor.pool_windows(win_kv, win_score, self.prev_a_kv[done], self.prev_a_score[done])  # [r, D]
        if compressor.overlap:
            d = compressor.head_dim
            self._save_half_a(done)
            self.prev_a_kv[done], self.prev_a_score[done] = win_kv[:, :, :d], win_score[:, :, :d]
        row_ids = pos[which] // m  # [r]
        return compressor.rows_at(pooled, row_ids), which, row_ids

    def export(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of the slot's state, the token count as a 0-d int64 tensor."""
        return {"kv": self.kv[slot].clone(), "score": self.score[slot].clone(),
                "prev_a_kv": self.prev_a_kv[slot].clone(), "prev_a_score": self.prev_a_score[slot].clone(),
                "num_tokens": torch.tensor(self.num_tokens[slot], dtype=torch.long)}

    def load(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Set the slot's state from `export`'s tensors."""
        for name, bank in (("kv", self.kv), ("score", self.score), ("prev_a_kv", self.prev_a_kv),
                           ("prev_a_score", self.prev_a_score)):
            bank[slot].copy_(tensors[name])
        self.num_tokens[slot] = int(tensors["num_tokens"])

    def write(self, slot: int, state: CompressorState) -> None:
        self._save_slot(slot)
        self.kv[slot].copy_(state.kv)
        self.score[slot].copy_(state.score)
        self.prev_a_kv[slot].copy_(state.prev_a_kv)
        self.prev_a_score[slot].copy_(state.prev_a_score)
        self.num_tokens[slot] = state.num_tokens

    # ---- undo of a failed step ------------------------------------------------------------------
    def begin_step(self) -> None:
        """Record, from now on, what the step changes (forgetting the last step's record)."""
        self._undo = []

    def undo_step(self) -> None:
        """Put back what was changed since `begin_step`, newest change first; recording stops
        until the next `begin_step`."""
        for undo in reversed(self._undo or []):
            undo()
        self._undo = None

    def _save_counts(self, slot_ids: list[int]) -> None:
        """Before a decode batch: the slots' token counts."""
        if self._undo is None:
            return
        counts = [self.num_tokens[slot] for slot in slot_ids]

        def undo() -> None:
            for slot, n in zip(slot_ids, counts, strict=True):
                self.num_tokens[slot] = n
        self._undo.append(undo)

    def _save_half_a(self, slots: torch.Tensor) -> None:
        """Before completed windows replace half A of `slots` [r]: its rows [r, m, D]."""
        if self._undo is None:
            return
        kv, score = self.prev_a_kv[slots], self.prev_a_score[slots]  # [r, m, D] (copies)

        def undo() -> None:
            self.prev_a_kv[slots], self.prev_a_score[slots] = kv, score
        self._undo.append(undo)

    def _save_slot(self, slot: int) -> None:
        """Before a span's state is written: the slot's count, open window rows and half A."""
        if self._undo is None:
            return
        n = self.num_tokens[slot]
        valid = n % self.kv.shape[1]
        kv, score = self.kv[slot, :valid].clone(), self.score[slot, :valid].clone()  # [n mod m, C]
        a_kv, a_score = self.prev_a_kv[slot].clone(), self.prev_a_score[slot].clone()  # [m | 0, D]

        def undo() -> None:
            self.kv[slot, :valid], self.score[slot, :valid] = kv, score
            self.prev_a_kv[slot], self.prev_a_score[slot] = a_kv, a_score
            self.num_tokens[slot] = n
        self._undo.append(undo)
