"""The worker's LoRA adapter slots: `max_loras` slots beside the model's target layers, filled on demand.

The engine decides which adapter each slot holds (`engine/adapter_slots.py`: pinned by running
requests, least recently used evicted) and names it on every request of the plan
(`ScheduledRequest.lora`, `.lora_slot`). Before the forward, `prepare` loads each named adapter whose
slot holds other content (by fingerprint), reading its files and checking that the bytes read are
those the request was admitted with; a file changed since is refused (the request fails, never
runs with other weights). Every tensor-parallel rank does the same with the same plan and keeps
its own slices (layers/lora.py).

    slot:      0            1            2
    holds:     fp(a)        fp(b)        None        <- `held`, compared with each plan's adapters
"""

from __future__ import annotations

import contextlib

import torch

from deepinfer.config import LoRAConfig
from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.lora import LoRAAdapter, LoRABase
from deepinfer.contracts.plan import StepPlan
from deepinfer.model_executor.layers.kernel_set import KernelSet
from deepinfer.model_executor.layers.lora import install_lora
from deepinfer.model_executor.loader.lora import adapter_modules, check_modules, max_adapter_bytes, read_adapter
from deepinfer.model_executor.models.utils import STACKED_PARAMS


class LoRASlots:
    """The adapter slots of one model on one rank."""

    def __init__(self, model, config: LoRAConfig, dtype: torch.dtype, device: torch.device, kernels: KernelSet,
                 batch_invariant: bool = False, hf_config=None):
        self.model = install_lora(model, STACKED_PARAMS, config.max_loras, config.max_lora_rank, dtype, device,
                                  kernels, batch_invariant)
        self.held: list[str | None] = [None] * config.max_loras  # the fingerprint each slot holds
        dtype_name = str(dtype).removeprefix("torch.")
        tag = f"lora_delta={kernels.lora_op(device, dtype)};dtype={dtype_name};invariant={int(batch_invariant)}"
        fields = HFConfigFields.of(hf_config)
        heads = {"num_attention_heads": fields.num_attention_heads, "num_key_value_heads": fields.num_key_value_heads}
        self.base = LoRABase(self.model.targets(), config.max_lora_rank, tag,
                             {name: value for name, value in heads.items() if value is not None})
        self.num_loads = 0

    def prepare(self, plan: StepPlan) -> None:
        """Load every adapter the plan names into its slot, where the slot holds other content."""
        for s in plan.scheduled:
            if s.lora is not None and self.held[s.lora_slot] != s.lora.fingerprint:
                self.load(s.lora_slot, s.lora)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Read `adapter` and write it into `slot`; ValueError naming it when its files changed since
        admission (or cannot be read any more). The slot holds nothing valid until this succeeds."""
        self.held[slot] = None
        config, tensors, identity = read_adapter(adapter.path, adapter.name, self.base.base_config,
                                                 max_adapter_bytes(self.base))
        if identity != adapter.fingerprint:
            raise ValueError(f"LoRA adapter {adapter.name!r} ({adapter.path}) changed on disk after the request "
                             f"was admitted; send the request again")
        modules = adapter_modules(config, tensors, adapter.name, adapter.path)
        check_modules(modules, self.base, adapter.name, adapter.path)
        self.model.write(slot, modules)
        self.held[slot] = adapter.fingerprint
        self.num_loads += 1

    def active(self, slots: torch.Tensor | None, spans) -> contextlib.AbstractContextManager:
        """The step's rows for the layers' hooks (`slots` [T], from input_batch; None: no adapter)."""
        used = frozenset(s.lora_slot for s, _ in spans if s.lora is not None)
        return self.model.active(slots, used)
