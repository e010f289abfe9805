"""The step's RoPE positions for a model that computes its own (M-RoPE, `capabilities.rope_positions`).

Such a model's rope positions depend on a request's pictures (Qwen2-VL: three rows t, h, w; text
after a picture shifted), which only the request knows and only the model can interpret. So the
runner asks the model once per scheduled request, in packed order, and concatenates:

    spans      r0 (decode, 1 row) | r1 (chunk, 4 rows)      | r2 (text only, 2 rows)
    rope       model.rope_positions(r0.pictures, s0, 1) | (r1.pictures, s1, 4) | ((), s2, 2)
               -> [3, T]

`positions` [T] (token indices) keep addressing the cache; these only rotate q and k.
"""

from __future__ import annotations

import torch


def step_rope_positions(model, spans, device: torch.device) -> torch.Tensor | None:
    """[3, T] rope positions of the step's packed rows, or None when the model has no positions of
    its own or no request of the step has a picture (then `positions` [T] are its rope positions).

    `spans`: (ScheduledRequest, first packed row) in packed order (`StepInputs.spans`)."""
    if not model.capabilities.rope_positions:
        return None
    if not any(s.pictures for s, _ in spans):
        return None
    parts = [model.rope_positions(s.pictures, s.start_pos, s.num_tokens) for s, _ in spans]
    return torch.cat(parts, dim=1).to(device)  # [3, T]


def rope_kwargs(model, spans, device: torch.device) -> dict:
    """The forward's `rope_positions=` keyword for this step ({} when it needs none)."""
    rope = step_rope_positions(model, spans, device)
    return {} if rope is None else {"rope_positions": rope}
