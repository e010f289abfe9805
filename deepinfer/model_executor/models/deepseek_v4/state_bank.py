"""Per-request compressor state, kept in the request's state slot (fixed shapes, fp32).

A `StateBank` holds one `CompressorState` per state slot of the ring group: the open window's
kv and scores, CSA's half A of the last complete window, and the token count. A request that
starts over (position 0: a new request, or one recomputed after preemption) gets a fresh state;
any other start must continue exactly where the slot's state ended.
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
        for name in ("kv", "score", "prev_a_kv", "prev_a_score"):
            getattr(self, name)[slot].copy_(tensors[name])
        self.num_tokens[slot] = int(tensors["num_tokens"])

    def write(self, slot: int, state: CompressorState) -> None:
        self.kv[slot].copy_(state.kv)
        self.score[slot].copy_(state.score)
        self.prev_a_kv[slot].copy_(state.prev_a_kv)
        self.prev_a_score[slot].copy_(state.prev_a_score)
        self.num_tokens[slot] = state.num_tokens
