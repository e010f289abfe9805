"""ModelRunner: builds the model and its cache groups, and turns a StepPlan into sampled tokens."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence

import torch

from deepinfer.config import CacheConfig, EngineConfig, SpeculativeConfig
from deepinfer.contracts.cache import CacheGroupSpec
from deepinfer.contracts.model import BoundCaches, CachedModel
from deepinfer.contracts.plan import (
    ModelOutput,
    SampleResult,
    ScheduledRequest,
    StepPlan,
    describe_fault,
    is_fatal_fault,
)
from deepinfer.environ import Environ
from deepinfer.model_executor import model_loader
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.attention.triton_backend import make_attention_backend
from deepinfer.model_executor.layers.batch_invariant import check_model_type, make_batch_invariant
from deepinfer.model_executor.layers.linear import use_few_row_linear
from deepinfer.model_executor.layers.ops.cache_common import (
    get_inference_swa_block_size,
    get_kvstore_swa_block_size,
)
from deepinfer.model_executor.layers.ops.swa_addressing import check_ring_fits_drafts
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.layers.sampling_metadata import device_tensor
from deepinfer.model_executor.model_loader import build_model, resolve_dtype, resolve_quantization, torch_dtype
from deepinfer.spec_decode.rejection import RejectionSampler, VerifyRow
from deepinfer.structured_output import StructuredOutputError
from deepinfer.worker.cache_canary import checked_identity
from deepinfer.worker.cache_engine import CacheEngine, RowCodec, make_codecs, page_rows, size_groups
from deepinfer.worker.cache_sizing import (
    RequestNeed,
    auto_cache_memory,
    check_fits_one_request,
    mib,
    min_over_ranks,
    wanted_snapshots,
)
from deepinfer.worker.cuda_graphs import build_decode_graphs
from deepinfer.worker.drafters import NgramDrafter
from deepinfer.worker.input_batch import StepInputs, build_step_inputs, group_addressing, num_logits_rows
from deepinfer.worker.kv_disk import KvDiskStore
from deepinfer.worker.mtp_drafter import MtpDrafter
from deepinfer.worker.prefix_store import PrefixStore, cache_identity
from deepinfer.worker.prompt_logprobs import PromptLogprobs
from deepinfer.worker.sampling_inputs import build_sampling_metadata
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


def ring_size(window: int, env: Environ) -> int:
    """S for a window W: the kv-store size when the prefill extra state is on (book §3.4.3)."""
    return get_kvstore_swa_block_size(window, env) if env.prefill_store_extra_state else \
        get_inference_swa_block_size(window, env)


def draft_environ(env: Environ, num_speculative_tokens: int) -> Environ:
    """The environment the ring helpers see: the config's draft allowance k as USE_NEXTN_DECODE."""
    return dataclasses.replace(env, use_nextn_decode=num_speculative_tokens)


class ModelRunner:
    """Owns the model, its cache groups and their one allocation each, and the sampler; turns a
    `StepPlan` into input tensors and per-group metadata, runs the model and samples."""

    emulate_cuda_graphs = False  # test switch: decode steps through DecodeGraphs' buffers without CUDA

    def __init__(self, source, config: EngineConfig):
        cache_config = config.cache
        self.device = resolve_device(config.device)
        # a backend this device cannot use fails here, before the weights load
        self.attention_backend = make_attention_backend(config.attention_backend, self.device,
                                                        config.env.batch_invariant)
        if config.env.batch_invariant:  # refuse a model the mode does not cover before loading it
            check_model_type(source.hf_config.model_type)
        self.quantization = resolve_quantization(config.quantization, source, self.device, config.env.batch_invariant)
        self.dtype_choice = resolve_dtype(config.dtype, self.device, source, self.quantization.value,
                                          config.env.batch_invariant)
        self.dtype = torch_dtype(self.dtype_choice)
        logger.info("quantization %s (%s); dtype %s (%s)", self.quantization.value, self.quantization.reason,
                    self.dtype_choice.value, self.dtype_choice.reason)
        self.model: CachedModel = build_model(source, self.dtype, self.device, config.max_model_len,
                                              config.speculative.method, self.quantization.value,
                                              config.expert_parallel_size)
        self.speculative = config.speculative
        self.env = draft_environ(config.env, self.speculative.num_speculative_tokens)
        self.num_few_row_linear = 0  # large linear layers that run a few rows as W @ x.T
        if self.env.batch_invariant:  # DEEPINFER_BATCH_INVARIANT: forward and logits in the invariant mode
            make_batch_invariant(self.model, source.hf_config.model_type)
        else:
            self.num_few_row_linear = use_few_row_linear(self.model)
        self.groups, self.codecs = self._sized_groups(cache_config)
        self.codec = self.codecs[0]
        self.num_state_slots, self.num_snapshot_slots, self.num_blocks = min_over_ranks(self._size_cache(
            cache_config, config.scheduler.max_num_seqs, config.max_model_len), self.device)  # alike on all ranks
        num_ring_units = self.num_state_slots + self.num_snapshot_slots
        units = [num_ring_units if g.is_ring else self.num_blocks for g in self.groups]
        self.cache = CacheEngine(self.groups, units, self.codecs, self.device)
        self.addressing = group_addressing(self.groups)
        self.model.bind_caches(BoundCaches(self.groups, [self.cache.group_caches(gi) for gi in range(len(self.groups))],
                                           num_ring_units, self.attention_backend))
        self.numerics = model_loader.numerics_record(self.model, self.device, self.dtype, self.quantization.value,
                                                     self.attention_backend.name, cache_config.kv_cache_dtype,
                                                     self.env.batch_invariant)  # every choice in a row's bits
        self.cache_identity = checked_identity(self, cache_identity(source, self.numerics, self.groups), cache_config)
        self.prefix = PrefixStore(self.cache, self.model, self.num_state_slots, self.num_snapshot_slots,
                                  self._disk_store(cache_config))
        self.sampler = Sampler(config.seed, batch_invariant=self.env.batch_invariant)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.prompt_logprobs = PromptLogprobs()  # gathered over prefill chunks, per request
        # rank 0 of several: where each step's sampled token ids go (plan_channel.DriverRunner)
        self.step_tokens_to: Callable[[dict[str, list[int]]], None] | None = None
        self.drafter = make_drafter(self.speculative, self.model, self.groups, self.addressing)
        self.structured = StructuredOutputs(getattr(source, "tokenizer", None), eos_ids_of(source))  # grammar masks
        self.graphs = build_decode_graphs(self.model, self.groups, self.attention_backend.name, self.device, config,
                                          emulate=self.emulate_cuda_graphs)  # the cache is bound: its addresses hold

    def _sized_groups(self, cache_config: CacheConfig) -> tuple[list[CacheGroupSpec], list[RowCodec]]:
        """The model's declared groups, sized (block size, ring S, page rows), with their codecs."""
        declared = self.model.cache_groups()
        codecs = make_codecs(declared, self.dtype, cache_config.kv_cache_dtype)
        groups = size_groups(declared, cache_config.block_size, self._ring_rows)
        groups = page_rows(groups, cache_config.block_size, codecs)
        for g in groups:
            if g.is_ring:
                check_ring_fits_drafts(g.window, g.rows_per_unit, self.speculative.num_speculative_tokens)
        return groups, codecs

    def _ring_rows(self, window: int) -> int:
        return ring_size(window, self.env)

    def codec_of(self, group: CacheGroupSpec) -> RowCodec:
        return self.codecs[self.groups.index(group)]

    def unit_bytes(self, group: CacheGroupSpec) -> int:
        """Bytes of one block (paged) or one state slot (ring) of a group."""
        return len(group.layer_ids) * group.rows_per_unit * self.codec_of(group).row_bytes

    def state_bytes(self) -> int:
        """Per-request state beside the rings (DeepSeek-V4's compressor state), in bytes."""
        return self.model.state_bytes_per_slot()

    def _size_cache(self, cache_config: CacheConfig, max_num_seqs: int, max_model_len: int) -> tuple[int, int, int]:
        """(state slots, snapshot slots, paged blocks), refused when one request at max_model_len
        does not fit. kv_cache_memory "auto" sizes for the need, capped (`cache_sizing`); an
        explicit size (or num_blocks) is split as `_num_state_slots` and `_num_blocks` say."""
        self.cache_need = need = self.request_need(max_model_len)
        snapshots = wanted_snapshots(cache_config, max_num_seqs) if self._per_request_bytes() else 0
        memory = cache_config.kv_cache_memory
        if cache_config.auto_sized:  # num_blocks alone: the rings get max_num_seqs slots, uncapped
            memory = None if cache_config.num_blocks else auto_cache_memory(
                need, max_num_seqs, snapshots, self.device, cache_config.gpu_memory_utilization)
            if memory is None:  # the whole need fits under the cap
                slots, blocks = max_num_seqs if need.ring_bytes else 0, max_num_seqs * need.num_blocks
                blocks = (cache_config.num_blocks or blocks) if need.page_bytes else 0
                check_fits_one_request(need, blocks, cache_config.num_blocks, 0, max_model_len)
                return slots, snapshots, blocks
        slots, snapshots = self._num_state_slots(memory, max_num_seqs, snapshots, need)
        num_blocks = self._num_blocks(cache_config, memory, slots, snapshots, need)
        check_fits_one_request(need, num_blocks, cache_config.num_blocks, memory, max_model_len)
        return slots, snapshots, num_blocks

    def request_need(self, max_model_len: int) -> RequestNeed:
        """What one request at max_model_len takes: paged blocks (all paged groups draw on one
        pool of equal pages) and the fixed bytes of its ring slots and state."""
        paged = [g for g in self.groups if not g.is_ring]
        blocks = sum(-(-(max_model_len // g.compress_ratio) // g.rows_per_unit) for g in paged)
        page = max((self.unit_bytes(g) for g in paged), default=0)
        return RequestNeed(blocks, page, self._per_request_bytes(), len(paged))

    def _num_state_slots(self, memory: int, max_num_seqs: int, wanted: int, need: RequestNeed) -> tuple[int, int]:
        """(state slots, snapshot slots) in `memory` bytes. One ring state slot per running
        request: max_num_seqs of them, unless they would take more than the rings' share of the
        cache memory (all of it without paged groups, else half; then as many as fit there;
        requests beyond wait). Prefix-cache snapshots (ring models) take what the running
        requests leave of that share, or a quarter of it."""
        if not need.ring_bytes:
            return 0, 0
        share = memory // 2 if need.page_bytes else memory
        fit = share // need.ring_bytes
        if fit < 1:
            raise ValueError(f"kv_cache_memory={memory:,} B ({mib(memory)}) cannot hold one request's "
                             f"sliding-window rings and state ({need.ring_bytes:,} B, {mib(need.ring_bytes)}"
                             f"{', with half the memory kept for paged blocks' if need.page_bytes else ''}); "
                             f"raise --kv-cache-memory")
        snapshots = min(wanted, max(fit - max_num_seqs, fit // 4))
        return min(max_num_seqs, fit - snapshots), snapshots

    def _per_request_bytes(self) -> int:
        return sum(self.unit_bytes(g) for g in self.groups if g.is_ring) + self.state_bytes()

    def _disk_store(self, cache_config) -> KvDiskStore | None:
        """The cache directory's store, refused at start-up if it cannot hold one unit."""
        if not cache_config.kv_cache_dir or not cache_config.enable_prefix_caching:
            return None
        paged = [self.unit_bytes(g) for g in self.groups if not g.is_ring]
        snapshot = self._per_request_bytes() + len(paged) * max(paged, default=0) if self.num_snapshot_slots else 0
        return KvDiskStore(cache_config.kv_cache_dir, cache_config.kv_cache_dir_size, self.cache_identity,
                           min_file_bytes=max(paged + [snapshot]))

    def disk_stats(self) -> dict:
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

    def _num_blocks(self, cache_config, memory: int, slots: int, snapshots: int, need: RequestNeed) -> int:
        """Paged blocks: num_blocks when given, else what `memory` holds beside the rings."""
        if not need.page_bytes:
            return 0
        if cache_config.num_blocks:
            return cache_config.num_blocks
        ring_bytes = need.ring_bytes * (slots + snapshots) + snapshots * need.num_paged_groups * need.page_bytes
        # all paged groups share one pool of same-size pages (cache_engine.page_rows)
        return max(0, (memory - ring_bytes) // need.page_bytes)

    def release(self, request_ids) -> None:
        """Drop per-request state (sampler generators, draft distributions) of finished or
        aborted requests."""
        request_ids = list(request_ids)
        self.sampler.release(request_ids)
        self.prompt_logprobs.release(request_ids)
        self.structured.release(request_ids)
        if self.drafter is not None:
            self.drafter.release(request_ids)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ModelOutput:
        """Run the plan's forward, sample (verifying drafts), then propose the next drafts. A
        forward fault raises (the engine isolates it); a sampling fault is retried request by
        request and requests that still fail come back in `errors`."""
        self.release(plan.finished_request_ids)
        if self.drafter is not None:
            self.drafter.release(plan.preempted_request_ids)  # they recompute, then draft afresh
        share = self.step_tokens_to if self.step_tokens_to is not None and self.needs_step_tokens(plan) else None
        plan, load_failures = self.prefix.prepare(plan)  # saves, loads, restores before the forward
        if plan.is_empty:
            if share is not None:
                share({})
            return ModelOutput(load_failures=load_failures)
        inputs = build_step_inputs(plan, self.addressing, self.device)
        if self.graphs is not None and self.graphs.accepts(inputs):  # plain decodes: replay a CUDA graph
            logits = self.graphs.run(inputs)  # [N, V]
        else:
            logits = self._forward(inputs)  # [M, V] or None
        output = ModelOutput()
        if inputs.sample_rows:
            output = self._sample(logits, inputs)
            self.prompt_logprobs.attach(inputs.sample_rows, output)
        if share is not None:  # the follower ranks wait for them before their own drafting passes
            share({rid: [r.token_id for r in results] for rid, results in output.samples.items()})
        self._keep_verified(inputs, output.samples)
        if self.drafter is not None:
            output.draft_token_ids = self.drafter.propose(inputs, output.samples)
        self.prefix.finish(plan)  # snapshots at the step's boundaries
        output.load_failures = load_failures
        return output

    @torch.inference_mode()
    def follow(self, plan: StepPlan, step_tokens: Callable[[], dict[str, list[int]]] = dict) -> None:
        """A follower rank's step (tensor parallelism, `worker/multiproc.py`): the cache copies and
        the forward of `execute`, with every collective in them (logits included: the LM head
        gathers), and no sampling. A plan for which `needs_step_tokens` then waits for
        `step_tokens()`, the tokens rank 0's sampling gave each request, and does with them what
        rank 0 did, at the same point: the kept counts to the model (`keep_verified`), and the
        passes of a drafter that runs the model (MTP: its drafts dropped, rank 0 has the same)."""
        needs = self.needs_step_tokens(plan)
        plan, _ = self.prefix.prepare(plan)  # its own slice files; failures agreed with rank 0 inside
        inputs = None if plan.is_empty else build_step_inputs(plan, self.addressing, self.device)
        if inputs is not None:
            if self.graphs is not None and self.graphs.accepts(inputs):
                self.graphs.run(inputs)  # [N, V], dropped
            else:
                self._forward(inputs, PromptLogprobs())  # prompt logprobs are rank 0's: gathered, dropped
        samples = {rid: [SampleResult(t, 0.0) for t in ids] for rid, ids in step_tokens().items()} if needs else {}
        if inputs is None:
            return
        self._keep_verified(inputs, samples)
        if self.drafts_on_every_rank:
            self.drafter.propose(inputs, samples)
        self.prefix.finish(plan)

    @property
    def drafts_on_every_rank(self) -> bool:
        """Whether the drafter runs the model (MTP), so every rank runs its passes."""
        return self.drafter is not None and self.drafter.runs_model

    def needs_step_tokens(self, plan: StepPlan) -> bool:
        """Whether follower ranks need this step's sampled tokens (a plan that verifies drafts, or
        any step with a drafter that runs the model)."""
        return bool(plan.scheduled) and (self.drafts_on_every_rank or any(s.verify for s in plan.scheduled))

    def _forward(self, inputs: StepInputs, prompt_logprobs: PromptLogprobs | None = None) -> torch.Tensor | None:
        """The eager forward: prompt logprobs gathered (into `prompt_logprobs`, default the
        runner's), then logits [M, V] of the rows that sample (None when none does)."""
        with forward_context(inputs.attn_metadata):
            hidden = self.model(inputs.input_ids, inputs.positions)  # [T, hidden]
        if any(s.prompt_logprobs is not None for s, _ in inputs.spans):
            into = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
            into.collect(inputs.spans, hidden, self.model.compute_logits)
        if not inputs.sample_rows:
            return None
        return self.model.compute_logits(hidden[inputs.sample_index]).float()  # [M, V]

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
