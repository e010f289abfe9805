"""The step executor: a `StepPlan` -> input tensors -> the model's forward -> sampled tokens.

Owns what one step needs beside the cache: the sampler (and the rejection sampler of verification
steps), prompt logprobs and pooling gathered over prefill chunks, the drafter, structured-output
masks, the decode CUDA graphs and the LoRA slots' step rows. The cache side of a step (the copies
before the forward, the snapshots after it, what a failed step undoes) is the cache runtime's
(`worker/cache_runtime.py`); the runner (`worker/model_runner.py`) composes the two.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.contracts.model import CachedModel
from deepinfer.contracts.plan import (
    ModelOutput,
    ScheduledRequest,
    StepPlan,
    StepTokens,
    describe_fault,
    is_fatal_fault,
)
from deepinfer.model_executor.forward_context import forward_context
from deepinfer.model_executor.layers.sampler import Sampler
from deepinfer.model_executor.layers.sampling_metadata import device_tensor
from deepinfer.spec_decode.rejection import RejectionSampler, VerifyRow
from deepinfer.structured_output import StructuredOutputError
from deepinfer.worker.cache_runtime import CacheRuntime
from deepinfer.worker.cpu_threads import StepThreads
from deepinfer.worker.cuda_graphs import build_decode_graphs
from deepinfer.worker.drafting import make_drafter
from deepinfer.worker.input_batch import StepInputs, build_step_inputs, num_logits_rows
from deepinfer.worker.lora_slots import LoRASlots
from deepinfer.worker.picture_rows import PictureRows
from deepinfer.worker.pooling import Pooler
from deepinfer.worker.prompt_logprobs import PromptLogprobs
from deepinfer.worker.rope_positions import rope_kwargs
from deepinfer.worker.sampling_inputs import build_sampling_metadata
from deepinfer.worker.structured import StructuredOutputs, eos_ids_of

logger = logging.getLogger("deepinfer.worker")


@dataclass
class Step:
    """One step between `StepExecutor.start` and `StepExecutor.finish`: the plan after the cache
    copies (requests whose saved files failed to load are left out), its inputs (None: nothing
    left to compute), what rank 0 sampled (`output`: its samples, the load failures; empty on a
    follower), and whether follower ranks need the step's tokens before they finish it."""

    plan: StepPlan
    inputs: StepInputs | None
    output: ModelOutput
    sampled: bool  # this rank sampled (rank 0, or a runner alone)
    needs_tokens: bool  # see `StepExecutor.needs_step_tokens`

    def tokens(self) -> StepTokens:
        """The message to the followers: the token ids this rank sampled."""
        return StepTokens.of(self.output)


class StepExecutor:
    """Runs steps on a built model whose caches `caches` holds: inputs, forward (eager or a decode
    CUDA graph), sampling with draft verification, then the next drafts."""

    threads = StepThreads(None, None)  # the runner sets the CPU policy (worker/cpu_threads.py)

    def __init__(self, source, config: EngineConfig, model: CachedModel, caches: CacheRuntime,
                 lora: LoRASlots | None, backend_name: str, batch_invariant: bool, emulate_graphs: bool = False):
        self.model, self.caches, self.lora, self.device = model, caches, lora, caches.device
        self.speculative = config.speculative  # the one source of the draft allowance k
        self.sampler = Sampler(config.seed, batch_invariant=batch_invariant)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.prompt_logprobs = PromptLogprobs()  # gathered over prefill chunks, per request
        self.pooler = Pooler()  # embedding requests' pools, over prefill chunks
        self.drafter = make_drafter(self.speculative, model, caches.addressing, self.device, caches.draft,
                                    source.hf_config.vocab_size, config.max_model_len, source.path,
                                    source.hf_config)
        self.structured = StructuredOutputs(source.tokenizer, eos_ids_of(source))  # grammar masks
        self.graphs = build_decode_graphs(model, caches.groups, backend_name, self.device, config,
                                          emulate=emulate_graphs)  # the cache is bound: its addresses hold
        # a picture model's encoder outputs (by content hash) and each step's picture rows
        self.pictures = PictureRows(model, self.device) if model.capabilities.pictures else None

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
            with self.threads.step():  # torch's thread count for the step (worker/cpu_threads.py)
                return self.finish(self.start(plan))
        except Exception as exc:
            if not is_fatal_fault(exc):
                self.caches.undo.undo()
            raise

    @torch.inference_mode()
    def follow(self, plan: StepPlan, receive_tokens: Callable[[], StepTokens] = StepTokens) -> None:
        """A follower rank's step (tensor parallelism, `worker/plan_channel.py`): `start` without
        sampling (the forward with every collective in it, logits included: the LM head gathers),
        then, where `step.needs_tokens`, `receive_tokens()` (rank 0's `StepTokens`), and `finish`
        with them: the kept counts to the model and the passes of a drafter that runs the model
        (MTP: its drafts dropped, rank 0 has the same)."""
        with self.threads.step():
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
        self.caches.undo.begin(plan)  # before the cache copies: a re-run copies again
        needs_tokens = self.needs_step_tokens(plan)
        plan, load_failures = self.caches.prefix.prepare(plan)  # saves, loads, restores before the forward
        step = Step(plan, None, ModelOutput(), sample, needs_tokens)
        if plan.is_empty:
            step.output.load_failures = load_failures
            return step
        if self.lora is not None:
            self.lora.prepare(plan)  # adapters into the slots the plan names
        step.inputs = inputs = build_step_inputs(plan, self.caches.addressing, self.device)
        if self.pictures is not None:
            inputs.picture_rows = self.pictures.build(inputs.spans)  # rows of pictures' encoder output
        pooled: dict[str, list[float]] = {}  # embeddings this step completes (rank 0)
        if (self.graphs is not None and inputs.lora_slots is None and inputs.picture_rows is None
                and self.graphs.accepts(inputs)):  # a CUDA graph
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
        self.caches.prefix.finish(step.plan)  # snapshots at the step's boundaries
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
        extra = {} if self.pictures is None else {"picture_rows": inputs.picture_rows}
        with forward_context(inputs.attn_metadata), self._lora_rows(inputs):
            extra.update(rope_kwargs(self.model, inputs.spans, inputs.positions.device))
            hidden = self.model(inputs.input_ids, inputs.positions, **extra)  # [T, hidden]
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
