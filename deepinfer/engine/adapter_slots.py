"""Which LoRA adapter each of the `max_loras` device slots holds. Pure Python.

A slot is keyed by the adapter's content (`LoRAAdapter.fingerprint`): two names for the same files
share one slot, and a file rewritten at the same path is new content that needs a slot of its own.
A running request pins its adapter's slot; an unpinned slot keeps its adapter (a later request
finds it loaded) until a slot is needed, then the least recently used one is taken. A request whose
adapter has no slot and cannot take one waits (`can_acquire` is False) until a running request
releases one.

    slots:     0: fp(a) pinned by 2     1: fp(b) unpinned (LRU)     2: free
    acquire(c) -> slot 2; acquire(d) -> slot 1 (b evicted); acquire(e) -> no slot: wait
"""

from __future__ import annotations

from collections import OrderedDict

from deepinfer.contracts.lora import LoRAAdapter


class AdapterSlotTable:
    """`num_slots` slots, each empty or holding one adapter content; pins per running request."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"max_loras must be a positive integer, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # fingerprint -> slot, least recently used first
        self._pins = [0] * num_slots  # running requests using each slot
        self._free = list(range(num_slots))
        self._requests: dict[str, int] = {}  # request id -> the slot it pins

    def can_acquire(self, adapter: LoRAAdapter) -> bool:
        """Whether `acquire` would find `adapter` a slot now."""
        return adapter.fingerprint in self._slot_of or bool(self._free) or self._victim() is not None

    def acquire(self, request_id: str, adapter: LoRAAdapter) -> int:
        """Pin a slot holding `adapter` for `request_id` (loaded there, or taken: a free slot, else the
        least recently used unpinned one). RuntimeError when none can be had (check `can_acquire`)."""
        if request_id in self._requests:
            raise RuntimeError(f"request {request_id!r} already holds LoRA slot {self._requests[request_id]}")
        slot = self._slot_of.get(adapter.fingerprint)
        if slot is None:
            slot = self._take()
            self._slot_of[adapter.fingerprint] = slot
        self._slot_of.move_to_end(adapter.fingerprint)
        self._pins[slot] += 1
        self._requests[request_id] = slot
        return slot

    def release(self, request_id: str) -> None:
        """Unpin the request's slot (a no-op if it holds none); the adapter stays loaded."""
        slot = self._requests.pop(request_id, None)
        if slot is not None:
            self._pins[slot] -= 1

    def slot_of(self, request_id: str) -> int:
        """The slot the request pins (-1: none)."""
        return self._requests.get(request_id, -1)

    @property
    def num_pinned(self) -> int:
        return sum(1 for n in self._pins if n)

    def _victim(self) -> str | None:
        return next((fp for fp, slot in self._slot_of.items() if not self._pins[slot]), None)

    def _take(self) -> int:
        if self._free:
            return self._free.pop(0)
        victim = self._victim()
        if victim is None:
            raise RuntimeError(f"all {self.num_slots} LoRA slots are pinned by running requests")
        return self._slot_of.pop(victim)

    def check(self) -> None:
        """Pins add up to the requests holding them; every slot is free or holds one content."""
        pins = [0] * self.num_slots
        for slot in self._requests.values():
            pins[slot] += 1
        if pins != self._pins or sorted(self._free + list(self._slot_of.values())) != list(range(self.num_slots)):
            raise AssertionError(f"LoRA slots: pins {self._pins} vs {pins}, free {self._free}, "
                                 f"held {dict(self._slot_of)}")
