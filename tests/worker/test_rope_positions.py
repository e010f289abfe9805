"""The step's rope positions for a model with positions of its own (worker/rope_positions.py)."""

from __future__ import annotations

import torch

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.worker.rope_positions import rope_kwargs, step_rope_positions


class _Model:
    """Rope positions (index * 10 + row) that show which request and index each column came from."""

    capabilities = ModelCapabilities(rope_positions=True)

    def __init__(self):
        self.calls = []

    def rope_positions(self, pictures, start, count):
        self.calls.append((pictures, start, count))
        return torch.arange(start, start + count).expand(3, count) * 10 + torch.arange(3)[:, None]  # [3, count]


def _span(start: int, count: int, pictures=()) -> ScheduledRequest:
    s = ScheduledRequest(f"r{start}", list(range(count)), start, ([0],))
    s.pictures = pictures  # all of the request's pictures, on every step
    return s


def test_packed_in_span_order_with_each_requests_pictures():
    model = _Model()
    spans = [(_span(7, 1, ("pic",)), 0), (_span(0, 3), 1)]
    rope = step_rope_positions(model, spans, torch.device("cpu"))
    assert rope.tolist() == [[70, 0, 10, 20], [71, 1, 11, 21], [72, 2, 12, 22]]
    assert model.calls == [(("pic",), 7, 1), ((), 0, 3)]


def test_none_without_pictures_or_without_the_capability():
    model = _Model()
    assert step_rope_positions(model, [(_span(0, 3), 0)], torch.device("cpu")) is None
    assert model.calls == []
    model.capabilities = ModelCapabilities()
    assert rope_kwargs(model, [(_span(0, 3, ("pic",)), 0)], torch.device("cpu")) == {}
