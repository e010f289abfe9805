"""ModelRunner: builds the model and its cache groups, and turns a StepPlan into sampled tokens."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig, SpeculativeConfig
from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.model import BoundCaches, CachedModel
from deepinfer.contracts.plan import (
    ModelOutput,
    ScheduledRequest,
    StepPlan,
    StepTokens,
    describe_fault,
    is_fatal_fault,
)
from deepinfer.model_executor import model_loader
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.attention.layer_cache import RowCodec
from deepinfer.model_executor.layers.attention.triton_backend import make_attention_backend
from deepinfer.model_executor.layers.batch_invariant import (
    check_model_type,
    make_batch_invariant,
    native_path,
    resolve_batch_invariant,
)
from deepinfer.model_executor.layers.linear import use_few_row_linear
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.layers.sampling_metadata import device_tensor
from deepinfer.model_executor.model_loader import build_model, resolve_dtype, resolve_quantization, torch_dtype
from deepinfer.spec_decode.rejection import RejectionSampler, VerifyRow
from deepinfer.structured_output import StructuredOutputError
from deepinfer.worker.cache_canary import checked_identity
from deepinfer.worker.cache_engine import CacheEngine
from deepinfer.worker.cache_sizing import min_over_ranks, plan_model_cache, size_cache
from deepinfer.worker.cuda_graphs import build_decode_graphs
from deepinfer.worker.drafters import NgramDrafter
from deepinfer.worker.input_batch import StepInputs, build_step_inputs, group_addressing, num_logits_rows
from deepinfer.worker.kv_disk import KvDiskStore
from deepinfer.worker.lora_slots import LoRASlots
from deepinfer.worker.mtp_drafter import MtpDrafter
from deepinfer.worker.pooling import Pooler
from deepinfer.worker.prefix_store import PrefixStore, cache_identity
from deepinfer.worker.prompt_logprobs import PromptLogprobs
from deepinfer.worker.sampling_inputs import build_sampling_metadata
from deepinfer.worker.step_undo import StepUndo
from deepinfer.worker.structured import StructuredOutputs, eos_ids_of

logger = logging.getLogger("deepinfer.worker")


def resolve_device(name: str | None) -> torch.device:
    """The device `config.device` names; a one-line ValueError naming the fix otherwise (`worker/device.py`)."""
    from deepinfer.worker import device

    return device.resolve_device(name)


def make_drafter(config: SpeculativeConfig, model, groups, addressing):
    """The drafter of `config.method` (None without one)."""
    if config.method is None:
        return None
    return NgramDrafter(config) if config.method == "ngram" else MtpDrafter(config, model, groups, addressing)


@dataclass
class Step:
    """One step between `ModelRunner.start` and `ModelRunner.finish`: the plan after the cache
    copies (requests whose saved files failed to load are left out), its inputs (None: nothing
    left to compute), what rank 0 sampled (`output`: its samples, the load failures; empty on a
    follower), and whether follower ranks need the step's tokens before they finish it."""

    plan: StepPlan
    inputs: StepInputs | None
    output: ModelOutput
    sampled: bool  # this rank sampled (rank 0, or a runner alone)
    needs_tokens: bool  # see `ModelRunner.needs_step_tokens`

    def tokens(self) -> StepTokens:
        """The message to the followers: the token ids this rank sampled."""
        return StepTokens.of(self.output)


class ModelRunner:
    """Owns the model, its cache groups and their one allocation each, and the sampler; turns a
    `StepPlan` into input tensors and per-group metadata, runs the model and samples."""

    emulate_cuda_graphs = False  # test switch: decode steps through DecodeGraphs' buffers without CUDA

    def __init__(self, source, config: EngineConfig):
        cache_config = config.cache
        self.device = resolve_device(config.device)
        model_type = source.hf_config.model_type
        knob = config.env.batch_invariant  # None: auto (on for the CPU path with its C++ kernels)
        self.quantization = resolve_quantization(config.quantization, source, self.device, bool(knob))
        self.dtype_choice = resolve_dtype(config.dtype, self.device, source, self.quantization.value, bool(knob))
        self.dtype = torch_dtype(self.dtype_choice)
        self.batch_invariant = resolve_batch_invariant(knob, self.device, config.attention_backend, model_type,
                                                       self.dtype)
        # a backend this device cannot use fails here, before the weights load
        self.attention_backend = make_attention_backend(config.attention_backend, self.device, self.batch_invariant)
        if self.batch_invariant:  # refuse a model the mode does not cover before loading it
            check_model_type(model_type)
        logger.info("quantization %s (%s); dtype %s (%s); batch-invariant %s", self.quantization.value,
                    self.quantization.reason, self.dtype_choice.value, self.dtype_choice.reason,
                    "on" if self.batch_invariant else "off")
        self.model: CachedModel = build_model(source, self.dtype, self.device, config.max_model_len,
                                              config.speculative.method, self.quantization.value,
                                              config.expert_parallel_size, config.activation_levels)
        self.speculative = config.speculative  # the one source of the draft allowance k
        self.env = config.env
        self.num_few_row_linear = 0  # large linear layers that run a few rows as W @ x.T
        if self.batch_invariant:  # DEEPINFER_BATCH_INVARIANT: forward and logits row-independent
            make_batch_invariant(self.model, model_type, native_path(self.device, self.dtype, model_type))
        else:
            self.num_few_row_linear = use_few_row_linear(self.model)
        # LoRA adapter slots beside the target layers (`lora_base`: what adapters may target, for admission)
        self.lora = LoRASlots(self.model, config.lora, self.dtype, self.device, self.batch_invariant,
                              source.hf_config) if config.lora.enable_lora else None
        self.lora_base = self.lora.base if self.lora is not None else None
        # the cache's one sizing (`cache_sizing`): groups sized for k drafts, their codecs, the byte record
        self.groups, self.codecs, self.sizing = plan_model_cache(
            self.model, self.dtype, cache_config.kv_cache_dtype, cache_config.block_size, self.env,
            self.speculative.num_speculative_tokens)
        self.codec = self.codecs[0]
        self.cache_need = self.sizing.request_need(config.max_model_len)
        self.num_state_slots, self.num_snapshot_slots, self.num_blocks = min_over_ranks(size_cache(
            self.cache_need, cache_config, config.scheduler.max_num_seqs, config.max_model_len, self.device),
            self.device)  # alike on all ranks
        num_ring_units = self.num_state_slots + self.num_snapshot_slots
        units = [num_ring_units if g.is_ring else self.num_blocks for g in self.groups]
        self.cache = CacheEngine(self.groups, units, self.codecs, self.device)
        self.addressing = group_addressing(self.groups)
        self.model.bind_caches(BoundCaches(self.groups, [self.cache.group_caches(gi) for gi in range(len(self.groups))],
                                           num_ring_units, self.attention_backend))
        self.numerics = model_loader.numerics_record(self.model, self.device, self.dtype, self.quantization.value,
                                                     self.attention_backend.name, cache_config.kv_cache_dtype,
                                                     self.batch_invariant)  # every choice in a row's bits
        self.cache_identity = checked_identity(self, cache_identity(source, self.numerics, self.groups), cache_config)
        self.prefix = PrefixStore(self.cache, self.model, self.num_state_slots, self.num_snapshot_slots,
                                  self._disk_store(cache_config))
        self.undo = StepUndo(self.cache, self.model)  # what a failed step changed that its re-run reads
        self.sampler = Sampler(config.seed, batch_invariant=self.batch_invariant)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.prompt_logprobs = PromptLogprobs()  # gathered over prefill chunks, per request
        self.pooler = Pooler()  # embedding requests' pools, over prefill chunks
        self.drafter = make_drafter(self.speculative, self.model, self.groups, self.addressing)
        self.structured = StructuredOutputs(getattr(source, "tokenizer", None), eos_ids_of(source))  # grammar masks
        self.graphs = build_decode_graphs(self.model, self.groups, self.attention_backend.name, self.device, config,
                                          emulate=self.emulate_cuda_graphs)  # the cache is bound: its addresses hold

    def codec_of(self, group: CacheGroupSpec) -> RowCodec:
        return self.codecs[self.groups.index(group)]

    def unit_bytes(self, group: CacheGroupSpec) -> int:
        """Bytes of one block (paged) or one state slot (ring) of a group."""
        return self.sizing.groups[self.groups.index(group)].unit_bytes

    def state_bytes(self) -> int:
        """Per-request state beside the rings (DeepSeek-V4's compressor state), in bytes."""
        return self.sizing.state_bytes

    def _disk_store(self, cache_config) -> KvDiskStore | None:
        """The cache directory's store, refused at start-up if it cannot hold one unit."""
        if not cache_config.kv_cache_dir or not cache_config.enable_prefix_caching:
            return None
        sizing = self.sizing
        snapshot = sizing.per_request + len(sizing.paged) * sizing.page_bytes if self.num_snapshot_slots else 0
        return KvDiskStore(cache_config.kv_cache_dir, cache_config.kv_cache_dir_size, self.cache_identity,
                           min_file_bytes=max(sizing.page_bytes, snapshot))

    def stats(self) -> dict[str, int]:
        """The cache directory's counters (empty without one)."""
        disk = self.prefix.disk
        if disk is None:
            return {}
        return {"kv_cache_dir_bytes_read": disk.bytes_read, "kv_cache_dir_bytes_written": disk.bytes_written,
                "kv_cache_dir_files_read": disk.files_read, "kv_cache_dir_files_written": disk.files_written,
                "kv_cache_dir_load_failures": disk.load_failures}

    def close(self) -> None:
        """Finish writing the cache directory (idempotent)."""
        self.prefix.close()

    def release(self, request_ids) -> None:
        """Drop per-request state (sampler generators, draft distributions) of finished or
        aborted requests."""
        request_ids = list(request_ids)
        self.sampler.release(request_ids)
        self.prompt_logprobs.release(request_ids)
        self.pooler.release(request_ids)
        self.structured.release(request_ids)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    # -- the step ------------------------------------------------------------------------------
    #
    #   start(plan)                              send point           finish(step, tokens)
    #   ───────────────────────────────────      ──────────────       ──────────────────────────────
    #   forget finished requests; cache copies   rank 0 -> ranks:     kept counts to the model
    #   (saves, loads, restores); forward;       StepTokens, when     (keep_verified); drafting (MTP
    #   sampling (rank 0 only)                   step.needs_tokens    passes on every rank); snapshots
    #
    # `execute` (one rank, or rank 0 via `DriverRunner`, which sends at the send point) and `follow`
    # (a follower rank, which receives there) are this one skeleton. Rank 0 must send before its
    # drafting passes: their collectives pair with the followers' passes, which need the tokens.

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ModelOutput:
        """Run the plan's forward, sample (verifying drafts), then propose the next drafts. A
        forward fault raises (the engine isolates it) after the per-request state and ring rows
        a re-run reads are put back (`worker/step_undo.py`); a sampling fault is retried request
        by request and requests that still fail come back in `errors`."""
        try:
            return self.finish(self.start(plan))
        except Exception as exc:
            if not is_fatal_fault(exc):
                self.undo.undo()
            raise

    @torch.inference_mode()
    def follow(self, plan: StepPlan, receive_tokens: Callable[[], StepTokens] = StepTokens) -> None:
        """A follower rank's step (tensor parallelism, `worker/plan_channel.py`): `start` without
        sampling (the forward with every collective in it, logits included: the LM head gathers),
        then, where `step.needs_tokens`, `receive_tokens()` (rank 0's `StepTokens`), and `finish`
        with them: the kept counts to the model and the passes of a drafter that runs the model
        (MTP: its drafts dropped, rank 0 has the same)."""
        step = self.start(plan, sample=False)
        self.finish(step, receive_tokens() if step.needs_tokens else None)

    @torch.inference_mode()
    def start(self, plan: StepPlan, sample: bool = True) -> Step:
        """The step up to the send point: forget finished requests, the cache copies, the forward
        and, with `sample`, the sampling (prompt logprobs attached) and the embeddings the step
        completed. A follower (`sample` False) gathers prompt logprobs and pools nowhere: they are
        rank 0's."""
        self.release(plan.finished_request_ids)
        if self.drafter is not None:
            self.drafter.release(plan.preempted_request_ids)  # they recompute, then draft afresh
        self.undo.begin(plan)  # before the cache copies: a re-run copies again
        needs_tokens = self.needs_step_tokens(plan)
        plan, load_failures = self.prefix.prepare(plan)  # saves, loads, restores before the forward
        step = Step(plan, None, ModelOutput(), sample, needs_tokens)
        if plan.is_empty:
            step.output.load_failures = load_failures
            return step
        if self.lora is not None:
            self.lora.prepare(plan)  # adapters into the slots the plan names
        step.inputs = inputs = build_step_inputs(plan, self.addressing, self.device)
        pooled: dict[str, list[float]] = {}  # embeddings this step completes (rank 0)
        if self.graphs is not None and inputs.lora_slots is None and self.graphs.accepts(inputs):  # a CUDA graph
            logits = self.graphs.run(inputs)  # [N, V]
        else:
            logits = self._forward(inputs, None if sample else PromptLogprobs(), pooled if sample else None)  # [M, V]
        if sample and inputs.sample_rows:
            step.output = self._sample(logits, inputs)
            self.prompt_logprobs.attach(inputs.sample_rows, step.output)
        step.output.load_failures, step.output.pooled = load_failures, pooled
        return step

    @torch.inference_mode()
    def finish(self, step: Step, tokens: StepTokens | None = None) -> ModelOutput:
        """The step after the send point: the kept counts of verification steps to the model,
        the next drafts (a follower runs only a drafter that runs the model, and drops its
        drafts), the snapshots at the step's boundaries. `tokens`: rank 0's, on a follower; rank 0
        uses its own samples."""
        if step.inputs is None:
            return step.output
        samples = step.output.samples if step.sampled else (tokens.samples() if tokens is not None else {})
        self._keep_verified(step.inputs, samples)
        if self.drafter is not None and (step.sampled or self.drafter.runs_model):
            drafts = self.drafter.propose(step.inputs, samples)
            if step.sampled:
                step.output.draft_token_ids = drafts
        self.prefix.finish(step.plan)  # snapshots at the step's boundaries
        return step.output

    @property
    def drafts_on_every_rank(self) -> bool:
        """Whether the drafter runs the model (MTP), so every rank runs its passes."""
        return self.drafter is not None and self.drafter.runs_model

    def needs_step_tokens(self, plan: StepPlan) -> bool:
        """Whether follower ranks need this step's sampled tokens (a plan that verifies drafts, or
        any step with a drafter that runs the model)."""
        return bool(plan.scheduled) and (self.drafts_on_every_rank or any(s.verify for s in plan.scheduled))

    def _forward(self, inputs: StepInputs, prompt_logprobs: PromptLogprobs | None = None,
                 pooled: dict[str, list[float]] | None = None) -> torch.Tensor | None:
        """The eager forward: prompt logprobs gathered (into `prompt_logprobs`, default the
        runner's), embedding chunks pooled (completed vectors into `pooled`; None: not pooled),
        then logits [M, V] of the rows that sample (None when none does)."""
        with forward_context(inputs.attn_metadata), self._lora_rows(inputs):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        if pooled is not None and any(s.pooling is not None for s, _ in inputs.spans):
            pooled.update(self.pooler.collect(inputs.spans, hidden))
        if any(s.prompt_logprobs is not None for s, _ in inputs.spans):
            into = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
            into.collect(inputs.spans, hidden, self.model.compute_logits)
        if not inputs.sample_rows:
            return None
        return self.model.compute_logits(hidden[inputs.sample_index]).float()  # [M, V]

    def _lora_rows(self, inputs: StepInputs) -> contextlib.AbstractContextManager:
        """The step's LoRA rows for the adapted layers' hooks (nothing without LoRA or adapters)."""
        if self.lora is None or inputs.lora_slots is None:
            return contextlib.nullcontext()
        return self.lora.active(inputs.lora_slots, inputs.spans)

    def _keep_verified(self, inputs: StepInputs, samples: dict) -> None:
        """Tell the model how many tokens of each verification step were kept (the last token
        and the accepted drafts), so per-request state beside the caches forgets the rest."""
        kept = {start: len(samples[s.request_id]) for s, start in inputs.spans
                if s.verify and s.request_id in samples}
        if kept:
            self.model.keep_verified(kept)

    def _sample(self, logits: torch.Tensor, inputs: StepInputs) -> ModelOutput:
        """Sample every request at once; if that raises, again request by request from the same
        generator states (sampling has no cache side effects), so the good ones draw what they
        would have."""
        rows, sizes = inputs.sample_rows, [num_logits_rows(s) for s in inputs.sample_rows]
        draws = any(row.sampling_params is not None and not row.sampling_params.greedy for row in rows)
        saved = self.sampler.save_generators(row.request_id for row in rows) if draws else None
        try:
            return self._sample_rows(logits, rows)
        except Exception as exc:
            if is_fatal_fault(exc):
                raise
            if not isinstance(exc, StructuredOutputError):  # a request's grammar: the engine logs its one line
                logger.warning("%s; sampling its %d requests one by one", describe_fault("sampling a batch", exc),
                               len(rows))
        if saved is not None:  # greedy rows draw nothing: nothing to rewind
            self.sampler.restore_generators(saved)
        output, first = ModelOutput(), 0
        for row, size in zip(rows, sizes, strict=True):
            try:
                output.update(self._sample_rows(logits[first:first + size], [row]))  # [size, V]
            except Exception as exc:
                if is_fatal_fault(exc):
                    raise
                if not isinstance(exc, StructuredOutputError):
                    logger.exception("request %r failed in sampling", row.request_id)
                output.errors[row.request_id] = describe_fault("sampling", exc)
            first += size
        return output

    def _sample_rows(self, logits: torch.Tensor, rows: Sequence[ScheduledRequest]) -> ModelOutput:
        """logits [M, V]: one row per plain request, k + 1 per verification step, in `rows`
        order -> their samples (plain rows through the sampler, verifications through the
        rejection sampler). Structured-output rows are masked to what their grammar allows first."""
        if self.structured.wanted(rows):
            logits = self.structured.apply(logits, rows)  # [M, V]
        sizes = [num_logits_rows(s) for s in rows]
        offsets = list(itertools.accumulate(sizes, initial=0))
        plain = [i for i, s in enumerate(rows) if not s.verify]
        verify = [i for i, s in enumerate(rows) if s.verify]
        output = ModelOutput()
        if plain:
            sampling = build_sampling_metadata([rows[i] for i in plain], self.device)
            results = self.sampler(_rows_at(logits, [offsets[i] for i in plain]), sampling)  # [N, V] in
            output.samples.update((rid, [r]) for rid, r in zip(sampling.request_ids, results, strict=True))
        if verify:
            index = torch.tensor([r for i in verify for r in range(offsets[i], offsets[i + 1])],
                                 device=logits.device)  # [M']
            checks = [self._verify_row(rows[i]) for i in verify]
            results = self.rejection_sampler(logits.index_select(0, index), checks)  # [M', V] in
            output.samples.update((c.request_id, r) for c, r in zip(checks, results, strict=True))
        return output

    def _verify_row(self, s: ScheduledRequest) -> VerifyRow:
        if s.sampling_params is None:
            raise ValueError(f"request {s.request_id!r} was given to the sampler without sampling_params")
        probs = self.drafter.draft_probs(s.request_id, s.draft_token_ids) if self.drafter is not None else None
        return VerifyRow(s.request_id, s.sampling_params, s.prompt_token_ids, s.output_token_ids,
                         s.draft_token_ids, probs)


def _rows_at(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits [M, V] -> its rows `rows` [N, V]; the tensor itself (no copy) when that is all of
    them in order, as in a step of plain decodes."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, device_tensor(rows, torch.long, logits.device))  # [N, V]
