"""LoRA adapters as plain data: what a caller asks for, and what the engine and the worker pass on.

    LoRARequest      the caller's choice (vLLM's shape): a name, an integer id, a path
    LoRAAdapter      the same adapter resolved at admission: its content identity, rank and path
    AdapterResolver  what turns the first into the second (the loader's PEFT reader does)

The engine keys a request's prefix chain with `LoRAAdapter.cache_key` (the adapter's content, never
its name) and gives it one of `max_loras` device slots; the worker loads the adapter at `path` into
that slot when the slot holds other content. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class LoRARequest:
    """One adapter to apply to a request: `lora_name` (how the caller names it), `lora_int_id` (a
    positive integer, as in vLLM) and `lora_path` (a PEFT directory with adapter_config.json and
    adapter_model.safetensors, or a GGUF LoRA file). Two requests with the same adapter content
    share cached prefixes whatever their names and ids."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path of adapter {self.lora_name!r} must be a path, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter checked against the base model at admission.

    `fingerprint` is the content identity of its files (bytes of the weights and the config), so a
    copy under another name or path has the same one and a file rewritten in place another;
    `cache_key` adds what else changes the bits of an adapted row (the LoRA op, the padded rank),
    and is what prefix hashes chain from."""

    name: str
    int_id: int
    path: str
    fingerprint: str
    cache_key: str
    rank: int  # the largest rank of its modules


@runtime_checkable
class AdapterResolver(Protocol):
    """Checks a LoRARequest against the base model and the LoRA limits (ValueError naming the
    adapter and what is wrong: a missing or corrupt file, a rank above max_lora_rank, a target
    module the base lacks) and returns the resolved adapter."""

    def resolve(self, request: LoRARequest) -> LoRAAdapter:
        ...


@dataclass(frozen=True)
class LoRABase:
    """What the base model offers adapters, as the worker built it: per HF name of a module an
    adapter may target (`model.layers.0.self_attn.q_proj`, ...) its (in, out) features, whole (as
    one rank sees the checkpoint); the largest rank a slot holds; and a tag of everything else that
    changes an adapted row's bits (the LoRA op, the dtype); and the base config's head counts
    (`num_attention_heads`, `num_key_value_heads`), which a GGUF adapter's q/k rows need."""

    targets: dict[str, tuple[int, int]]
    max_lora_rank: int
    numerics_tag: str
    base_config: dict = field(default_factory=dict)
