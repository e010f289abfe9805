"""LLMEngine: the step loop. plan = schedule(); out = runner.execute(plan); update(plan, out).

This module never touches tensors and imports neither the worker nor the model executor: the
composing code above it (`deepinfer.compose.build_engine`) loads the model source, builds the runner
and hands both in.

Fault isolation: one bad request never takes the engine down. Every per-request value is checked
before admission (`add_request`, `SamplingParams.validate`). Inside a step (`step_isolation.py`):

    runner.execute(plan) raises ----> each request again, alone (sub-plans of one request); those
                                      whose solo step fails are failed, the others' results used
                                      (the runner has put back what the step changed that a
                                      re-run reads: `StepRunner.execute`)
    the runner's sampling fails ----> it retries row by row and reports failed rows in
                                      `ModelOutput.errors`; the engine fails those requests
    output processing raises -------> that request is failed

A failed request finishes with `RequestStatus.FINISHED_ERROR` (finish_reason "error"), its output
carries a `RequestFailedError`, its blocks and state slots go back to the pool and the runner
forgets it. A fault no request can be blamed for (`is_fatal_fault`: out of memory, a device error,
`FatalStepError`; or every solo retry failing; or a one-request step failing right after another
one-request step failed) propagates out of `step()`: the engine's state is then unknown and the
caller decides (abort, exit). A single one-request step that fails fails its request only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref

from deepinfer.config import EngineConfig
from deepinfer.contracts.hf_config import end_of_generation_ids
from deepinfer.contracts.lora import AdapterResolver, LoRAAdapter, LoRARequest
from deepinfer.contracts.model import StepRunner
from deepinfer.contracts.multimodal import PictureInput, check_pictures
from deepinfer.contracts.plan import StepPlan, describe_fault, is_fatal_fault
from deepinfer.contracts.pooling import PoolingParams
from deepinfer.engine import pooling
from deepinfer.engine.adapter_slots import AdapterSlotTable
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec, RingGroupSpec
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.parallel_sampling import ParallelSampling, ParentRequest
from deepinfer.engine.prefix_cache import PrefixSettings
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.step_isolation import IsolatedSteps
from deepinfer.outputs import EmbeddingRequestOutput, RequestFailedError, RequestOutput
from deepinfer.sampling_params import SamplingParams, check_token_ids_in_vocab, short_repr

logger = logging.getLogger("deepinfer.engine")


class LLMEngine:
    """Owns the requests, the scheduler with its block pool, and output processing; drives the
    runner it is given (`StepRunner`) one step at a time. `source` gives the tokenizer and the
    model's config (vocabulary, EOS ids); `adapters` checks the LoRA adapters requests name (with
    LoRA on, `config.lora.enable_lora`)."""

    def __init__(self, config: EngineConfig, source, runner: StepRunner, adapters: AdapterResolver | None = None):
        self.config, self.source, self.runner = config, source, runner
        self.isolated = IsolatedSteps()  # the runner's step, faults pinned on their requests
        self.adapters = adapters
        self.tokenizer = source.tokenizer
        self.kv_manager = KVCacheManager(kv_group_specs(runner.groups), num_blocks=runner.num_blocks,
                                         num_state_slots=runner.num_state_slots,
                                         prefix=prefix_settings(config, runner), unit=config.cache.block_size)
        lora_slots = AdapterSlotTable(config.lora.max_loras) if config.lora.enable_lora else None
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.max_model_len, lora_slots)
        # every token that ends a generation (EOS, EOT, EOM, the FIM pad/separator, ...): one set for
        # the stop check, min_tokens and structured output
        self.eos_token_ids = end_of_generation_ids(source.hf_config, source.tokenizer, source.generation_config)
        self.outputs = OutputProcessor(self.tokenizer, source.hf_config.vocab_size, self.eos_token_ids)
        # how embedding requests pool (the checkpoint's declaration, or config.pooling's override)
        self.pooling = pooling.pooling_config(source.path, source.hf_config, config.pooling)
        logger.info("%s", self.pooling.summary())
        # close() once: explicitly, when the engine is collected, or at exit (never holding the engine)
        self._finalizer = weakref.finalize(self, close_engine, self.kv_manager, runner)
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []  # final outputs of aborts, returned by the next step
        self.samples = ParallelSampling()  # requests with n / best_of > 1 and their child requests

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens of one request: the config's, resolved before the model was built."""
        return self.config.max_model_len

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0, client_id: str | None = None,
                    pictures: tuple[PictureInput, ...] = ()) -> str:
        """Queue one request; raises ValueError (naming the field and value) if it is invalid.
        `priority` (lower first; non-zero needs scheduling_policy "priority") and `client_id` (whose
        request, for the fair share between clients) order it in the waiting queue (engine/request_queue.py).
        Requests share cached prefixes only when their `cache_salt` is equal (None included) and
        their LoRA adapters have the same content (`lora_request`: checked here, ValueError naming
        the adapter when it cannot run).
        With `params.n` / `best_of` > 1 its samples run as sibling requests sharing the prompt's
        blocks (`parallel_sampling`); its outputs come under `request_id`, one completion each.
        With `PoolingParams` it is an embedding request: its final output is an
        `EmbeddingRequestOutput` (engine/pooling.py).
        `pictures`: the prompt's pictures (`PictureInput`, processed for the model, each at its run
        of placeholder tokens in the prompt); ValueError for a model without a vision encoder or a
        run that does not fit the prompt."""
        if isinstance(params, PoolingParams):
            if pictures:
                raise ValueError("pictures are not supported for embedding requests (PoolingParams)")
            return self._add_embedding(prompt, params, request_id, cache_salt)
        params = checked_params(params)
        check_token_ids_in_vocab(params, self.source.hf_config.vocab_size)
        adapter = self.resolve_adapter(lora_request)
        request_id = self._new_request_id(request_id, cache_salt)
        text, ids = self._tokenize(prompt)
        self._validate_prompt(ids, params.max_tokens)
        pictures = self._checked_pictures(pictures, len(ids))

        def make(rid: str, p: SamplingParams) -> Request:
            return Request(rid, ids, p, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len,
                           cache_salt=cache_salt, lora=adapter, priority=priority, client_id=client_id,
                           pictures=pictures, whole_picture_runs=bool(pictures) and self.runner.whole_picture_runs)

        if params.num_samples == 1:
            self._admit(make(request_id, params), text)
            return request_id
        parent = self.samples.add(request_id, text, params, make)
        try:
            for child in parent.children:
                self._check_free(child.request_id, owner=request_id)
            self._admit(parent.children[0], text)  # the siblings go in once it has computed the prompt
        except BaseException:
            self.samples.forget(parent)
            raise
        return request_id

    def _checked_pictures(self, pictures, prompt_len: int) -> tuple[PictureInput, ...]:
        """`pictures` as a tuple of `PictureInput`s whose runs fit the prompt; ValueError naming
        `pictures` for a model without a vision encoder or a malformed one."""
        pictures = tuple(pictures or ())
        if not pictures:
            return ()
        if not self.runner.pictures:
            raise ValueError(f"pictures: model_type {self.source.hf_config.model_type!r} takes no pictures "
                             f"(it has no vision encoder); got {len(pictures)}")
        for i, p in enumerate(pictures):
            if not isinstance(p, PictureInput):
                raise ValueError(f"pictures[{i}] must be a PictureInput, got {type(p).__name__}")
        check_pictures(pictures, prompt_len)
        budget = self.config.scheduler.max_num_batched_tokens
        longest = max(p.length for p in pictures)
        if self.runner.whole_picture_runs and longest > budget:
            raise ValueError(f"pictures: a picture of {longest} placeholder tokens must fit one prefill chunk "
                             f"for model_type {self.source.hf_config.model_type!r} (its pictures attend to "
                             f"themselves whole); max_num_batched_tokens={budget} is smaller")
        return pictures

    def resolve_adapter(self, lora_request: LoRARequest | None) -> LoRAAdapter | None:
        """The checked adapter of `lora_request` (None for None); ValueError naming it when it cannot
        run here (LoRA off, missing or corrupt files, a rank above max_lora_rank, targets the base
        lacks)."""
        if lora_request is None:
            return None
        if self.adapters is None or not self.config.lora.enable_lora:
            name = lora_request.lora_name if isinstance(lora_request, LoRARequest) else lora_request
            raise ValueError(f"lora_request names adapter {name!r}, but LoRA is off: start the engine with "
                             f"enable_lora=True (--enable-lora)")
        return self.adapters.resolve(lora_request)

    def _add_embedding(self, prompt, params: PoolingParams, request_id: str | None, cache_salt: str | None) -> str:
        """Queue an embedding request: its prompt (cut to truncate_prompt_tokens) is computed and
        pooled as the model declares (`self.pooling`); nothing is sampled."""
        params = self.pooling.resolve(params)
        request_id = self._new_request_id(request_id, cache_salt)
        text, ids = self._tokenize(prompt)
        ids = pooling.truncated(ids, params, self.max_model_len)
        pooling.check_prompt(ids, self.max_model_len, self.source.hf_config.vocab_size)
        self._admit(pooling.pooling_request(request_id, ids, params, self.max_model_len, cache_salt), text)
        return request_id

    def _new_request_id(self, request_id: str | None, cache_salt: str | None) -> str:
        """The request's id (a fresh one for None), free; ValueError for a bad id or salt."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {short_repr(cache_salt)}")
        request_id = request_id or f"req-{next(self._ids)}"
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {short_repr(request_id)}")
        self._check_free(request_id)
        return request_id

    def _admit(self, req: Request, text: str | None, share_from: Request | None = None) -> None:
        self.outputs.add(req, text)
        try:
            self.scheduler.add_request(req, share_from)  # refuses what the cache can never hold
        except BaseException:
            self.outputs.drop(req.request_id)
            raise

    def _check_free(self, request_id: str, owner: str | None = None) -> None:
        """ValueError if an unfinished request (or a sample of one) has this id."""
        if self.scheduler.get_request(request_id) is not None or (
                self.samples.knows(request_id) and owner is None):
            raise ValueError(f"request_id {(owner or request_id)!r} is already in use"
                             + (f" (its sample id {request_id!r} is taken)" if owner else ""))

    def abort_request(self, request_id: str) -> bool:
        """Abort at any point; the request's final output ("abort") comes with the next step().
        Aborting a request with several samples aborts all of them (a sample's own id is refused)."""
        parent = self.samples.get(request_id) if isinstance(request_id, str) else None
        if parent is not None:
            return self._abort_parent(parent)
        if self.samples.knows(request_id):
            return False
        req = self.scheduler.get_request(request_id)
        if req is None or not self.scheduler.abort_request(request_id):
            return False
        out = self.outputs.abort(req)
        if out is not None:
            self._aborted.append(out)
        self.runner.release([request_id])
        return True

    def _abort_parent(self, parent: ParentRequest) -> bool:
        outs = []
        for child in parent.children:
            req = self.scheduler.get_request(child.request_id)
            if req is not None and self.scheduler.abort_request(child.request_id):
                outs.append(self.outputs.abort(req))
                self.runner.release([child.request_id])
        final = self.samples.finish_aborted(parent, [out for out in outs if out is not None])
        if final is not None:
            self._aborted.append(final)
        return True

    def _admit_siblings(self) -> list[RequestOutput]:
        """Queue the held samples whose first sibling has computed the prompt; a refused one
        (it cannot be: its first sibling passed the same checks) ends failed."""
        failed = []
        for parent, child in self.samples.take_ready():
            try:
                self._admit(child, parent.prompt, share_from=parent.children[0])
            except ValueError as exc:
                self.outputs.add(child, parent.prompt)
                failed.append(self.outputs.fail(child, RequestFailedError(child.request_id, str(exc))))
        return failed

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.samples.has_pending

    def get_metrics(self) -> dict:
        """Counters since start, the one source of the engine's metrics (`LLM.get_metrics`, the
        server's /metrics): running / waiting requests, preemptions, KV blocks, the prefix cache's
        and the runner's counters (`StepRunner.stats`: the KV cache directory), and the
        speculative-decoding counters (`SpecDecodeStats.as_dict`: drafts, draft tokens, accepted
        tokens, acceptance per draft position, acceptance rate, mean accepted length)."""
        kv = self.kv_manager
        return {**kv.stats.as_dict(), "prefix_caching": kv.caching,
                "num_cached_blocks": kv.num_cached_blocks, "num_prefix_snapshots": len(kv.snapshots.by_key),
                **self.runner.stats(),
                "num_requests_running": self.scheduler.num_running,
                "num_requests_waiting": self.scheduler.num_waiting,
                "num_preemptions": self.scheduler.num_preemptions_total,
                "kv_cache_usage": kv.usage, "num_free_blocks": kv.num_free_blocks,
                "num_total_blocks": kv.num_total_blocks,
                "speculative_method": self.config.speculative.method,
                "num_speculative_tokens": self.config.speculative.num_speculative_tokens,
                **self.scheduler.spec_stats.as_dict()}

    def close(self) -> None:
        """Save what the cache directory still lacks, then close the runner (its writer; with several
        ranks, their processes and group). Idempotent; also done when the engine is garbage collected
        and at exit. Unfinished requests are left as they are; the engine must not step again."""
        self._finalizer()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """One engine step; returns an output (with deltas) for every request that changed (an
        embedding request's one output when it finishes).

        A request failed by a fault comes back finished with finish_reason "error"; only a fatal
        fault (see the module docstring) raises."""
        plan = self.scheduler.schedule()
        output = self.isolated.execute(self.runner, plan)
        failed = [self._fail(req, message) for rid, message in output.errors.items()
                  if (req := self.scheduler.get_request(rid)) is not None]
        updated = self.scheduler.update(plan, output)
        results = [self._process(u.request, u.samples, u.embedding) for u in updated]
        self.runner.release([u.request.request_id for u in updated if u.request.is_finished])
        failed += self._admit_siblings()
        aborted, self._aborted = self._aborted, []
        return self.samples.fold(aborted + failed + results)

    def _fail(self, req: Request, message: str) -> RequestOutput:
        """End `req` with FINISHED_ERROR: free its cache, forget its runner state, report it."""
        if req.is_finished:  # already freed (e.g. it hit max_tokens in this step)
            req.status = RequestStatus.FINISHED_ERROR
        else:
            self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        self.runner.release([req.request_id])
        logger.error("request %r failed: %s", req.request_id, message)
        return self.outputs.fail(req, RequestFailedError(req.request_id, message))

    def _process(self, req: Request, samples: list, embedding: list[float] | None = None
                 ) -> RequestOutput | EmbeddingRequestOutput:
        """Fold the step's kept samples (or an embedding's vector) into req's output; a fault here
        fails req alone."""
        try:
            if req.pooling_params is not None:
                return self.outputs.embedding(req, embedding)
            return self._process_sample(req, samples)
        except Exception as exc:
            if is_fatal_fault(exc):
                raise
            logger.exception("request %r failed in output processing", req.request_id)
            return self._fail(req, describe_fault("output processing", exc))

    def _process_sample(self, req: Request, samples: list) -> RequestOutput:
        stop, taken = self.outputs.update(req, samples)
        if taken < len(samples):  # a stop string inside a verified run: its later tokens never were
            req.truncate_outputs(req.num_output_tokens - (len(samples) - taken))
        if stop is not None:  # a stop string ends the request, even in the step that hit max_tokens
            if req.is_finished:
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
        return self.outputs.output(req)

    # -- helpers --------------------------------------------------------------------------------

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt is a string ({prompt[:40]!r}), but the model at {self.source.path!r} "
                                 "ships no tokenizer: pass a list of token ids")
            return prompt, list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _validate_prompt(self, ids: list[int], max_tokens: int) -> None:
        """The prompt is not empty, and it fits the context with max_tokens outputs (as the server checks)."""
        if not ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                             f"(the prompt plus at least one output token must fit)")
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={max_tokens} with a prompt of {len(ids)} tokens exceeds max_model_len "
                             f"{self.max_model_len}: use max_tokens <= {self.max_model_len - len(ids)}")
        vocab = self.source.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {short_repr(bad[0])} is outside the vocabulary [0, {vocab})")


def close_engine(kv_manager: KVCacheManager, runner: StepRunner) -> None:
    """LLMEngine's finalizer: save the units the cache directory lacks; close the runner even if
    saving fails."""
    try:
        persist = kv_manager.take_persist()
        if persist:
            runner.execute(StepPlan([], persist=persist))
    finally:
        kv_manager.close_disk()
        runner.close()


def checked_params(params: SamplingParams | None) -> SamplingParams:
    """A validated copy of the request's params (the caller may change or reuse its object);
    ValueError naming the field and the value when one is invalid."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params)  # runs the constructor's validation on every field


def prefix_settings(config: EngineConfig, runner: StepRunner) -> PrefixSettings:
    """The prefix cache the engine keeps over the runner's groups (see `CacheConfig`)."""
    cache = config.cache
    return PrefixSettings(enabled=cache.enable_prefix_caching, identity=runner.cache_identity,
                          kv_cache_dir=cache.kv_cache_dir if cache.enable_prefix_caching else None,
                          snapshot_interval=cache.prefix_snapshot_interval,
                          num_snapshot_slots=runner.num_snapshot_slots)


def kv_group_specs(groups) -> tuple:
    """The runner's cache groups as the block manager sees them (sizes only, no tensors)."""
    return tuple(RingGroupSpec(g.name, g.rows_per_unit) if g.is_ring
                 else PagedGroupSpec(g.name, g.rows_per_unit, g.compress_ratio) for g in groups)
