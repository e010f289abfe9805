"""Per-request compressor state, kept in the request's state slot (fixed shapes, fp32).

A `StateBank` holds one `CompressorState` per state slot of the ring group: the open window's
kv and scores, CSA's half A of the last complete window, and the token count. A request that
starts over (position 0: a new request, or one recomputed after preemption) gets a fresh state;
any other start must continue exactly where the slot's state ended.
"""

from __future__ import annotations

from deepinfer.model_executor.models.deepseek_v4.compressor import CompressorState


class StateBank:
    def __init__(self, initial: CompressorState, num_slots: int):
        self.initial = initial
        self.kv = initial.kv.expand(num_slots, -1, -1).clone()  # [slots, m, C]
        self.score = initial.score.expand(num_slots, -1, -1).clone()  # [slots, m, C]
        self.prev_a_kv = initial.prev_a_kv.expand(num_slots, -1, -1).clone()  # [slots, m | 0, D]
        self.prev_a_score = initial.prev_a_score.expand(num_slots, -1, -1).clone()  # [slots, m | 0, D]
        self.num_tokens = [0] * num_slots

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.score, self.prev_a_kv, self.prev_a_score))

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

    def write(self, slot: int, state: CompressorState) -> None:
        self.kv[slot].copy_(state.kv)
        self.score[slot].copy_(state.score)
        self.prev_a_kv[slot].copy_(state.prev_a_kv)
        self.prev_a_score[slot].copy_(state.prev_a_score)
        self.num_tokens[slot] = state.num_tokens
