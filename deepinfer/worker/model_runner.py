"""ModelRunner: one rank's engine side, composed of three parts, built in this order:

    numerics     every choice that changes a row's bits (quantization, dtype, batch-invariant mode,
                 attention backend and its kernel set, CPU ISA; few-row linears after the build),
                 resolved together before the build into one NumericsRecord (`worker/numerics.py`),
                 logged once, and hashed by the cache identity
    config       the EngineConfig with max_model_len resolved before any model is built
                 (`worker/context_length.py`); every model, the cache and the engine read it
    caches       the cache runtime (`worker/cache_runtime.py`): sizing, the allocation bound to the
                 model, the canary-checked identity, the prefix store and the undo of failed steps
    steps        the step executor (`worker/step_executor.py`): a StepPlan -> inputs -> forward ->
                 sampled tokens and drafts

With speculative_model a draft model is loaded and built after the target, under the same
numerics (`spec_decode/draft_model.py`); the cache runtime gives it rows at the target's addresses
and the cache identity covers both.

The runner is the engine's `StepRunner` (contracts/model.py): those members are its own. Everything
else is reached through its parts (`runner.caches.sizing`, `runner.steps.drafter`, ...).
"""

from __future__ import annotations

import logging

import torch

from deepinfer.config import EngineConfig
from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.model import CachedModel
from deepinfer.contracts.plan import ModelOutput, StepPlan
from deepinfer.model_executor.layers.attention.triton_backend import attention_backend_on
from deepinfer.model_executor.layers.batch_invariant import make_batch_invariant, native_path
from deepinfer.model_executor.layers.kernel_set import KERNEL_SETS
from deepinfer.model_executor.layers.linear import use_few_row_linear
from deepinfer.model_executor.model_loader import Choice, build_model
from deepinfer.spec_decode.draft_source import DraftModel, load_draft, open_draft
from deepinfer.worker.cache_runtime import CacheRuntime
from deepinfer.worker.context_length import Built, resolve_max_model_len
from deepinfer.worker.cpu_threads import StepThreads
from deepinfer.worker.device import resolve_device
from deepinfer.worker.draft_cache import combined_identity, draft_identity
from deepinfer.worker.lora_slots import LoRASlots
from deepinfer.worker.numerics import compute_dtype, resolve_numerics, with_weights
from deepinfer.worker.prefix_store import cache_identity
from deepinfer.worker.step_executor import StepExecutor

__all__ = ["ModelRunner", "resolve_device"]

logger = logging.getLogger("deepinfer.worker")


class ModelRunner:
    """Owns the model and composes its numerics record, cache runtime and step executor."""

    emulate_cuda_graphs = False  # test switch: decode steps through DecodeGraphs' buffers without CUDA

    # the StepRunner's cache layout (set once the caches are open)
    groups: list[CacheGroupSpec]
    num_blocks: int
    num_state_slots: int
    num_snapshot_slots: int
    cache_identity: str
    pictures: bool  # the model takes pictures (ModelCapabilities.pictures)
    whole_picture_runs: bool  # a prefill chunk holds a picture's run whole (ModelCapabilities)

    def __init__(self, source, config: EngineConfig):
        self.device = resolve_device(config.device)
        # every numerics choice, before the weights load (a choice this device cannot make fails here)
        self.numerics = resolve_numerics(source, config, self.device)
        self.dtype, self.batch_invariant = compute_dtype(self.numerics), self.numerics.batch_invariant
        draft_source = open_draft(config, source, self.device, self.batch_invariant) \
            if config.speculative.method == "draft_model" else None
        # max_model_len, once, before any model is built: every model, the cache and the engine read this config
        self.config = config = resolve_max_model_len(Built(source, self.dtype, self.numerics.quantization,
                                                           draft_source), config, self.device)
        self.attention_backend = attention_backend_on(self.numerics.attention_backend,
                                                      KERNEL_SETS[self.numerics.kernel_set], self.batch_invariant)
        self.model: CachedModel = build_model(source, self.dtype, self.device, config.max_model_len,
                                              config.speculative.method, self.numerics.quantization,
                                              config.expert_parallel_size, config.activation_levels)
        self.num_few_row_linear = self._settle_linears()
        self.pictures = self.model.capabilities.pictures
        self.whole_picture_runs = self.model.capabilities.whole_picture_runs
        self.draft: DraftModel | None = None if draft_source is None else load_draft(
            config, draft_source, self.numerics, self.dtype, self.device)
        # LoRA adapter slots beside the target layers (`lora_base`: what adapters may target, for admission)
        self.lora = LoRASlots(self.model, config.lora, self.dtype, self.device, self.attention_backend.kernels,
                              self.batch_invariant, source.hf_config) if config.lora.enable_lora else None
        self.lora_base = self.lora.base if self.lora is not None else None
        self.caches = CacheRuntime(self.model, config, self.dtype, self.device, self.attention_backend,
                                   None if self.draft is None else self.draft.model)
        self.numerics = with_weights(self.numerics, self.model, self.num_few_row_linear)  # the model is final
        logger.info("numerics: %s", self.numerics.describe())
        self.caches.open(self._identity(source), config.cache)
        caches = self.caches
        self.groups, self.num_blocks, self.num_state_slots = caches.groups, caches.num_blocks, caches.num_state_slots
        self.num_snapshot_slots, self.cache_identity = caches.num_snapshot_slots, caches.cache_identity
        self.steps = StepExecutor(source, config, self.model, self.caches, self.lora, self.attention_backend.name,
                                  self.batch_invariant, emulate_graphs=self.emulate_cuda_graphs)
        self.steps.threads = StepThreads.for_numerics(self.numerics, torch.get_num_threads())

    def _identity(self, source) -> str:
        """The cache identity: the target's rows, and the draft's when its rows share the units."""
        identity = cache_identity(source, self.numerics, self.caches.groups)
        if self.draft is None:
            return identity
        return combined_identity(identity, draft_identity(self.draft, self.numerics, self.caches.draft.groups))

    def _settle_linears(self) -> int:
        """The model's linear layers as the numerics say: batch-invariant (DEEPINFER_BATCH_INVARIANT:
        forward and logits row-independent), else large ones as few-row linears where a probe finds
        W @ x.T faster. Returns how many layers run as few-row linears."""
        if self.batch_invariant:
            make_batch_invariant(self.model, native_path(self.device, self.dtype, self.model.capabilities))
            return 0
        return use_few_row_linear(self.model)

    @property
    def quantization(self) -> Choice:
        """The resolved quantization and why (`deepinfer info`, the start-up summary)."""
        return Choice(self.numerics.quantization, self.numerics.reason("quantization"))

    @property
    def dtype_choice(self) -> Choice:
        """The compute dtype's name and why."""
        return Choice(self.numerics.compute_dtype, self.numerics.reason("dtype"))

    # -- the StepRunner protocol (contracts/model.py) ------------------------------------------------
    def execute(self, plan: StepPlan) -> ModelOutput:
        """Run the plan: forward, sampling (verifying drafts), the next drafts (`StepExecutor.execute`)."""
        return self.steps.execute(plan)

    def release(self, request_ids) -> None:
        """Drop per-request state (sampler generators, draft distributions) of finished or aborted requests."""
        self.steps.release(request_ids)

    def stats(self) -> dict[str, int]:
        """The cache directory's counters (empty without one)."""
        return self.caches.stats()

    def close(self) -> None:
        """Finish writing the cache directory (idempotent)."""
        self.caches.close()
