"""Parallel sampling: `n` / `best_of` samples of one prompt as sibling requests. Pure Python.

A request whose params ask for k = best_of (or n) > 1 samples becomes k child requests
`"{request_id}#{i}"`, each an ordinary request to the scheduler with n = 1 and its own random
stream: a seeded request's child i draws from seed + i, so the set of outputs repeats, and
child 0 is the request n = 1 would have been.

The prompt is computed once. Child 0 goes in first; its siblings wait here until child 0 has
computed the whole prompt, then join the queue at child 0's place in line and, on admission,
start from child 0's full prompt blocks (ref-counted, shared; see
`KVCacheManager.sibling_prefix`, which needs no prefix cache). Ring models share through the
prefix cache's snapshots when it is on, and recompute the prompt otherwise.

    add:    child 0 -> scheduler          children 1..k-1 held (`pending`)
    step:   child 0 prefills the prompt   ... until its num_computed_tokens >= prompt length
    then:   children 1..k-1 -> scheduler, sharing child 0's prompt blocks

The children's outputs fold into one RequestOutput under the parent's id, `outputs[i]` being
child i (index i). With best_of > n nothing is reported until every child finished; then the
n children of highest cumulative logprob are returned, best first, with indices 0..n-1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from deepinfer.engine.request import Request
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

_SEED_SPAN = SEED_MAX - SEED_MIN + 1


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index`'s params: one sample, and for a seeded request its own seed (seed + index,
    wrapped into the seed range), so that siblings draw different tokens."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - SEED_MIN) % _SEED_SPAN + SEED_MIN
    return dataclasses.replace(params, n=1, best_of=None, seed=seed)


@dataclass(eq=False)
class ParentRequest:
    """One prompt's samples: the children, those not yet handed to the scheduler, and each
    child's latest completion (index = child index)."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    children: list[Request]
    pending: list[Request] = field(default_factory=list)
    completions: list[CompletionOutput] = field(default_factory=list)
    changed: set[int] = field(default_factory=set)  # children with news since the last output
    finished: set[int] = field(default_factory=set)
    num_cached_tokens: list[int] = field(default_factory=list)
    num_preemptions: list[int] = field(default_factory=list)
    error: Exception | None = None
    template: RequestOutput | None = None  # a child's first output: the prompt-side fields

    def __post_init__(self):
        k = len(self.children)
        self.pending = list(self.children[1:])
        self.completions = [CompletionOutput(index=i) for i in range(k)]
        self.num_cached_tokens, self.num_preemptions = [0] * k, [0] * k
        self._index = {child.request_id: i for i, child in enumerate(self.children)}

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == len(self.children)

    def ready(self) -> bool:
        """Child 0 has computed the prompt (or ended): its siblings may go in."""
        first = self.children[0]
        return first.is_finished or first.num_computed_tokens >= first.num_prompt_tokens

    def update(self, out: RequestOutput) -> None:
        """Take child `out.request_id`'s latest output."""
        i = self._index[out.request_id]
        self.completions[i] = replace(out.outputs[0], index=i)
        self.changed.add(i)
        self.num_cached_tokens[i], self.num_preemptions[i] = out.num_cached_tokens, out.num_preemptions
        self.error = self.error or out.error
        self.template = self.template or out
        if out.finished:
            self.finished.add(i)

    def abort_pending(self) -> None:
        """The children never handed to the scheduler end as aborted, with no tokens."""
        for child in self.pending:
            i = self._index[child.request_id]
            self.completions[i] = CompletionOutput(index=i, finish_reason="abort")
            self.finished.add(i)
        self.pending = []

    def output(self) -> RequestOutput | None:
        """The prompt's output after this step (None while best_of > n is not done): every
        child's completion, those without news this step with empty deltas."""
        if self.params.num_samples > self.params.n and not self.is_finished:
            self.changed.clear()
            return None
        completions = [c if i in self.changed else _no_delta(c) for i, c in enumerate(self.completions)]
        self.completions, self.changed = [_no_delta(c) for c in completions], set()
        if self.params.num_samples > self.params.n:
            completions = best_completions(completions, self.params.n)
        base = self.template or RequestOutput(self.request_id, self.prompt, self.children[0].prompt_token_ids, [])
        failed = any(c.finish_reason == "error" for c in completions)  # best_of may leave a failed one out
        return replace(base, request_id=self.request_id, prompt=self.prompt, outputs=completions,
                       finished=self.is_finished, error=self.error if failed else None,
                       num_preemptions=sum(self.num_preemptions),
                       num_cached_tokens=self.num_cached_tokens[0])


def best_completions(completions: list[CompletionOutput], n: int) -> list[CompletionOutput]:
    """The n completions of highest cumulative logprob, best first (ties: lower index first; one
    failed by a fault last), re-indexed 0..n-1; each delta is its whole output (nothing of it was
    reported before)."""
    ranked = sorted(completions, key=lambda c: (c.finish_reason == "error", -c.cumulative_logprob, c.index))[:n]
    return [replace(c, index=j, delta_text=c.text, delta_token_ids=list(c.token_ids)) for j, c in enumerate(ranked)]


def _no_delta(c: CompletionOutput) -> CompletionOutput:
    return replace(c, delta_text="", delta_token_ids=[])


class ParallelSampling:
    """The engine's parents (requests with more than one sample) and which child belongs to which."""

    def __init__(self):
        self._parents: dict[str, ParentRequest] = {}
        self._parent_of: dict[str, ParentRequest] = {}  # child id -> its parent

    def knows(self, request_id: str) -> bool:
        """The id is an unfinished parent's or one of its children's."""
        return request_id in self._parents or request_id in self._parent_of

    def get(self, request_id: str) -> ParentRequest | None:
        return self._parents.get(request_id)

    @property
    def has_pending(self) -> bool:
        return any(p.pending for p in self._parents.values())

    def add(self, request_id: str, prompt: str | None, params: SamplingParams,
            make_child: Callable[[str, SamplingParams], Request]) -> ParentRequest:
        """Build the parent and its `params.num_samples` children (`make_child(id, params)`)."""
        children = [make_child(child_id(request_id, i), child_params(params, i)) for i in range(params.num_samples)]
        parent = ParentRequest(request_id, prompt, params, children)
        self._parents[request_id] = parent
        self._parent_of.update((c.request_id, parent) for c in children)
        return parent

    def forget(self, parent: ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for child in parent.children:
            self._parent_of.pop(child.request_id, None)

    def take_ready(self) -> list[tuple[ParentRequest, Request]]:
        """(parent, child) for every held child whose child 0 has computed the prompt; they leave
        `pending` (the caller hands them to the scheduler)."""
        ready = []
        for parent in self._parents.values():
            if parent.pending and parent.ready():
                ready.extend((parent, child) for child in parent.pending)
                parent.pending = []
        return ready

    def fold(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs with the children's replaced by one output per parent (after the
        others, in order of first news); a finished parent is forgotten."""
        result, touched = [], {}
        for out in outputs:
            parent = self._parent_of.get(out.request_id)
            if parent is None:
                result.append(out)
                continue
            parent.update(out)
            touched[parent.request_id] = parent
        for parent in touched.values():
            out = parent.output()
            if out is not None:
                result.append(out)
            if parent.is_finished:
                self.forget(parent)
        return result

    def finish_aborted(self, parent: ParentRequest, child_outputs: list[RequestOutput]) -> RequestOutput | None:
        """The final output of an aborted parent, from its children's abort outputs; forgets it."""
        for out in child_outputs:
            parent.update(out)
        parent.abort_pending()
        for i, c in enumerate(parent.completions):  # a child with no output to report ends aborted too
            if i not in parent.finished:
                parent.completions[i] = replace(c, finish_reason=c.finish_reason or "abort")
                parent.finished.add(i)
        self.forget(parent)
        return parent.output()
