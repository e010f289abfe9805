"""Continuous batching with chunked prefill and preemption by recompute. Pure Python.

One counter per request, `num_computed_tokens`, drives everything: a step computes
`token_ids[num_computed_tokens : num_computed_tokens + n]`, and the request samples its next
token when the step reaches `num_tokens`. Prefill, a prefill chunk, a decode token and the
recompute of a preempted request (prompt + outputs from position 0) are all this one move.

    token_ids:  p p p p p p p o o          (p: prompt, o: outputs so far)
                ^ computed ^|<-- n -->|    the step's chunk; samples if it ends at num_tokens

Each step, under a budget of `max_num_batched_tokens` tokens:
0. priority policy: the worst running requests of strictly worse priority than the best waiting
   one are preempted while it lacks a seat or blocks for its first chunk;
1. running requests, best first, take `min(num_tokens - num_computed_tokens, budget left)`;
   a request whose blocks do not fit preempts the worst running request (maybe itself);
2. if step 1 preempted nothing, waiting requests are admitted in the queue's order
   (`request_queue`: the policy's order, shared fairly between clients) while seats
   (`max_num_seqs`), budget and blocks for their first chunk last; admission stops at the first
   request that does not fit, and at one preempted in this step (no thrashing within a step).

Speculative decoding: the runner returns drafts with a request's sampled tokens; a decode
request holding drafts is scheduled as one verification span `[last token] + k'` drafts, k' cut
to what max_tokens, the model length and the token budget leave. The step's samples (accepted
drafts + the target's next token) advance `num_computed_tokens` by their count; blocks that only
rejected positions needed go back to the pool (`KVCacheManager.trim`).

Prefix caching: a request admitted with nothing computed (new, or back after preemption) starts
at its longest cached prefix (`KVCacheManager.find_prefix`); the hit's tokens cost no budget.
A ring model's prefill chunk stops at each snapshot boundary (`Request.snapshot_at`) so that its
rings can be copied there (`ScheduledRequest.capture_to`). After every step the request's newly
full blocks and snapshots are registered (`KVCacheManager.commit`); a request whose saved-cache
files failed to load starts over without them.

Parallel sampling: the samples of one prompt are sibling requests; the engine queues a sibling
(`add_request(req, share_from=first)`) once the first has computed the prompt, and on admission
it starts from the longer of its cached prefix and the first's full prompt blocks, shared
ref-counted (`KVCacheManager.sibling_prefix`; also without the prefix cache).

Embeddings (`engine/pooling.py`): an embedding request is scheduled as a prompt (chunked alike) that
never samples; it takes no prefix hit, may fill the whole context, and finishes in the `update` of
the step that completes its prompt, with the vector the runner pooled (`ModelOutput.pooled`).

LoRA (`adapter_slots`): a request with an adapter is admitted only when its adapter has, or can
take, one of the `max_loras` device slots (else it waits, and those behind it wait too); it pins
the slot while it runs and unpins it when it finishes, is preempted or starts over.

Order invariant: `running` is sorted by the policy's `order_key` (priority, arrival): the victim
is `running[-1]` (fcfs: the newest). Scheduled tokens are charged to the client (fair share).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from deepinfer.config import SchedulerConfig
from deepinfer.contracts.plan import ModelOutput, SampleResult, ScheduledRequest, StepPlan
from deepinfer.engine.adapter_slots import AdapterSlotTable
from deepinfer.engine.kv_manager import KVCacheManager, PrefixHit
from deepinfer.engine.request import (
    Request,
    RequestStatus,
    check_new_request,
    chunk,
    drafts_to_verify,
    length_limit,
    outside_runs,
    stop_of,
)
from deepinfer.engine.request_queue import make_request_queue
from deepinfer.engine.spec_stats import SpecDecodeStats


@dataclass(frozen=True)
class RequestUpdate:
    """What `Scheduler.update` decided for one request that got tokens this step: the samples it
    kept (appended to the request), in order. A verification run is cut after the first token
    that ended the request; its later samples never were."""

    request: Request
    samples: list[SampleResult]
    embedding: list[float] | None = None  # an embedding request's vector (it finished this step)


class Scheduler:
    """Owns the waiting and running queues and decides each step's work (`schedule` -> StepPlan);
    takes the step's samples back (`update`); allocates and frees blocks through the KV manager."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int,
                 adapter_slots: AdapterSlotTable | None = None):
        self.config = scheduler_config
        self.max_model_len = max_model_len  # the engine's, resolved before the model was built (EngineConfig)
        self.kv_manager = kv_manager
        self.adapter_slots = adapter_slots  # LoRA device slots (None: LoRA off)
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting = make_request_queue(scheduler_config.scheduling_policy)  # WAITING and PREEMPTED
        self.running: list[Request] = []  # RUNNING, sorted by waiting.order_key (best first)
        self.num_preemptions_total = 0
        self.spec_stats = SpecDecodeStats()
        self._finished_request_ids: list[str] = []  # since the last schedule()
        self._share_from: dict[str, Request] = {}  # request id -> a sibling sample whose prompt blocks it may share

    # ---- requests -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def add_request(self, req: Request, share_from: Request | None = None) -> None:
        """Queue a request; ValueError if it could never run to its end.

        `share_from`: a sibling sample of the same prompt (parallel sampling) that computed it
        already; req takes its place in line by arrival and, on admission, shares the sibling's
        full prompt blocks if it still holds them (`KVCacheManager.sibling_prefix`)."""
        self._validate(req)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        if share_from is not None:
            self._share_from[req.request_id] = share_from
        self.waiting.add(req)

    def _validate(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use by an unfinished request")
        self.waiting.check(req)  # priority (the policy's), client_id
        check_new_request(req, self.length_limit(req), self.kv_manager.max_num_tokens, self.adapter_slots is not None)

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting, running or preempted request; False if unknown or already finished."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> bool:
        """End an unfinished request (e.g. a stop string matched) and free its cache."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status!r}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status, stop_reason)
        return True

    def _finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None) -> None:
        """Mark finished, free its cache (its computed blocks stay cached, unless it failed),
        forget it; the caller takes it out of its queue."""
        if status is not RequestStatus.FINISHED_ERROR:
            self.kv_manager.commit(req)
        req.status, req.stop_reason = status, stop_reason
        self.kv_manager.free(req.request_id)
        self._release_adapter(req)
        del self.requests[req.request_id]
        self._share_from.pop(req.request_id, None)
        self._finished_request_ids.append(req.request_id)

    # ---- schedule -----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Decide this step's work (see the module docstring)."""
        scheduled, preempted, for_waiting = [], [], self._preempt_for_waiting()
        budget = self._schedule_running(scheduled, preempted)
        if not preempted:
            self._schedule_waiting(scheduled, budget, set(map(id, for_waiting)))
        finished, self._finished_request_ids = self._finished_request_ids, []
        preempted_ids = [r.request_id for r in for_waiting + preempted]
        return StepPlan(scheduled, finished, preempted_ids, self.kv_manager.take_persist())

    def _preempt_for_waiting(self) -> list[Request]:
        """Priority policy: preempt running requests of strictly worse priority than the best waiting
        one, worst first, while it lacks a seat or blocks for its first chunk (counted without prefix
        hits: maybe one more than needed). The victims wait behind it: none returns in this step."""
        head, victims = self.waiting.peek() if self.waiting.preemptive else None, []
        while (head is not None and self.running and self.running[-1].priority > head.priority
               and not self._could_admit(head)):
            victims.append(self.running.pop())
            self._preempt(victims[-1])
        return victims

    def _could_admit(self, req: Request) -> bool:
        first_chunk = min(req.num_tokens, self.config.max_num_batched_tokens)
        return (len(self.running) < self.config.max_num_seqs
                and self.kv_manager.can_allocate(req.request_id, first_chunk))

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted: list[Request]) -> int:
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = chunk(req, req.num_computed_tokens, budget)
            drafts = drafts_to_verify(req, self.length_limit(req), budget)
            if not num_new and not drafts:  # a picture's run that must come whole waits for a fuller budget
                i += 1
                continue
            if not self._allocate_or_preempt(req, num_new + len(drafts), preempted):
                break  # req preempted itself: it was the worst, nothing runs after it
            scheduled.append(self._scheduled_request(req, num_new, drafts))
            self.waiting.charge(req, num_new + len(drafts))
            budget -= num_new + len(drafts)
            i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, preempted: list[Request]) -> bool:
        """Get blocks for req's next `num_new` tokens, preempting the worst first; False if req went."""
        while not self.kv_manager.allocate_slots(req.request_id, req.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Free req's cache and queue it in its place; it will recompute prompt + outputs."""
        self.kv_manager.free(req.request_id)
        self._release_adapter(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []  # the recompute's last chunk proposes afresh
        req.snapshot_at = []
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add(req)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int, preempted: set[int]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if id(req) in preempted:
                break  # preempted in this step: back in a later one
            hit = self._find_prefix(req)
            req.snapshot_at = outside_runs(req, self.kv_manager.snapshot_boundaries(req, hit.num_tokens))
            num_new = chunk(req, hit.num_tokens, budget)
            if not num_new or not self._adapter_fits(req) or not self.kv_manager.allocate_slots(
                    req.request_id, hit.num_tokens + num_new, hit):
                break  # nobody overtakes the head of the queue
            if req.lora is not None:
                self.adapter_slots.acquire(req.request_id, req.lora)
            req.num_computed_tokens = hit.num_tokens
            if self.kv_manager.caching:
                self.kv_manager.stats.observe(req.num_tokens, hit.num_tokens, hit.num_disk_tokens)
            if not req.num_output_tokens and not req.num_preemptions:  # first admission (or a start-over)
                req.num_cached_tokens = hit.num_tokens
            self.waiting.admit(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=self.waiting.order_key)
            scheduled.append(self._scheduled_request(req, num_new))
            self.waiting.charge(req, num_new)
            budget -= num_new

    def _adapter_fits(self, req: Request) -> bool:
        """The request has no adapter, or its adapter has (or can take) a device slot."""
        return req.lora is None or self.adapter_slots.can_acquire(req.lora)

    def _release_adapter(self, req: Request) -> None:
        if req.lora is not None:
            self.adapter_slots.release(req.request_id)

    def _find_prefix(self, req: Request) -> PrefixHit:
        """req's longest cached prefix, or the prompt blocks of its sibling sample if longer."""
        hit = self.kv_manager.find_prefix(req)
        source = self._share_from.get(req.request_id)
        if source is None:
            return hit
        shared = self.kv_manager.sibling_prefix(req, source)
        return shared if shared.num_tokens > hit.num_tokens else hit

    def _scheduled_request(self, req: Request, num_new: int, drafts: list[int] = ()) -> ScheduledRequest:
        start, end = req.num_computed_tokens, req.num_computed_tokens + num_new
        if end in req.snapshot_at:
            self.kv_manager.reserve_snapshot(req, end)
        loads, restore_from, capture_to = self.kv_manager.step_ops(req.request_id)
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids[start:end] + list(drafts),
            start_pos=start,
            block_ids=self.kv_manager.block_ids(req.request_id),
            state_ids=self.kv_manager.state_ids(req.request_id),
            sampling_params=req.sampling_params if end == req.num_tokens and req.pooling_params is None else None,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            verify=bool(drafts),
            prompt_logprobs=req.sampling_params.prompt_logprobs if not req.num_output_tokens else None,
            pooling=req.pooling_params,
            pictures=req.pictures,
            loads=loads,
            restore_from=restore_from,
            capture_to=capture_to,
            lora=req.lora,
            lora_slot=self.adapter_slots.slot_of(req.request_id) if req.lora is not None else -1,
        )

    # ---- update -------------------------------------------------------------------------
    def update(self, plan: StepPlan, output: ModelOutput) -> list[RequestUpdate]:
        """Apply a step's results: advance, append sampled tokens, stop, free. `output` is read,
        never changed.

        Returns, for each request that got new tokens this step (finished ones included), in plan
        order, the samples it kept. Requests aborted since `schedule()` are skipped. A
        verification step's tokens are appended one by one, each checked for a stop as plain
        decoding would; the first that ends the request ends the run (the kept samples stop there).
        """
        updated = []
        for sched in plan.scheduled:
            req = self.requests.get(sched.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            if sched.request_id in output.load_failures:
                self._start_over(req, output.load_failures[sched.request_id])
                continue
            if sched.pooling is not None:
                updated += self._pool(req, sched, output)
                continue
            if not sched.do_sample:
                req.num_computed_tokens += sched.num_tokens
                self.kv_manager.commit(req)
                continue
            samples = output.samples.get(sched.request_id)
            if not samples or len(samples) > sched.num_tokens:
                raise RuntimeError(f"request {sched.request_id!r} was planned to sample a token "
                                   f"but the model output has {len(samples or [])} for its "
                                   f"{sched.num_tokens}-token step")
            self._advance(req, sched, samples)
            kept = samples[:self._append(req, samples)]
            self.kv_manager.commit(req)  # a no-op once finished (committed before its cache was freed)
            req.draft_token_ids = [] if req.is_finished else output.draft_token_ids.get(req.request_id, [])
            updated.append(RequestUpdate(req, kept))
        if any(u.request.is_finished for u in updated):
            self.running = [req for req in self.running if not req.is_finished]
        return updated

    def _pool(self, req: Request, sched: ScheduledRequest, output: ModelOutput) -> list[RequestUpdate]:
        """An embedding request's chunk: count it; the chunk that completes the prompt brings the
        pooled vector and ends the request (its blocks freed)."""
        req.num_computed_tokens += sched.num_tokens
        self.kv_manager.commit(req)
        if req.num_computed_tokens < req.num_tokens:
            return []
        embedding = output.pooled.get(sched.request_id)
        if embedding is None:
            raise RuntimeError(f"request {sched.request_id!r} completed its prompt for an embedding, but "
                               f"the model output has no pooled vector for it")
        self._finish(req, RequestStatus.FINISHED_STOPPED, None)
        return [RequestUpdate(req, [], embedding)]

    def _start_over(self, req: Request, paths: list[str]) -> None:
        """Saved-cache files of req's step could not be read (it was left out of the step): forget
        them, free its cache and queue it in its place to start again."""
        self.kv_manager.forget_paths(paths, req.num_computed_tokens)
        self.kv_manager.free(req.request_id)
        self._release_adapter(req)
        self.running.remove(req)
        req.num_computed_tokens, req.draft_token_ids, req.snapshot_at = 0, [], []
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def _advance(self, req: Request, sched: ScheduledRequest, samples: list) -> None:
        """Count the step's computed tokens: all of a plain step; of a verification step, the
        last token and the accepted drafts (one fewer than the samples). Blocks that only the
        rejected positions needed are freed."""
        if not sched.verify:
            req.num_computed_tokens += sched.num_tokens
            return
        self.spec_stats.observe(len(sched.draft_token_ids), len(samples) - 1)
        req.num_computed_tokens += len(samples)
        self.kv_manager.trim(req.request_id, req.num_computed_tokens)

    def _append(self, req: Request, samples: list) -> int:
        """Append sampled tokens until one ends the request; returns how many were appended."""
        for i, sample in enumerate(samples):
            req.append_output(sample.token_id)
            self._check_stop(req)
            if req.is_finished:
                return i + 1
        return len(samples)

    def _check_stop(self, req: Request) -> None:
        """Finish req if its last output token ends it (`request.stop_of`)."""
        stop = stop_of(req, self.length_limit(req))
        if stop is not None:
            self._finish(req, *stop)

    def length_limit(self, req: Request) -> int:
        return length_limit(req, self.max_model_len)
