"""LLMEngine: the step loop. plan = schedule(); out = runner.execute(plan); update(plan, out).

This module never touches tensors and imports neither the worker nor the model executor: the
composing code above it (`deepinfer.llm.build_engine`) loads the model source, builds the runner
and hands both in.
"""

from __future__ import annotations

import itertools

from deepinfer.config import EngineConfig
from deepinfer.contracts.model import StepRunner
from deepinfer.engine.kv_manager import KVCacheManager, PagedGroupSpec, RingGroupSpec
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.request import Request, RequestStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams


class LLMEngine:
    """Owns the requests, the scheduler with its block pool, and output processing; drives the
    runner it is given (`StepRunner`) one step at a time. `source` gives the tokenizer and the
    model's config (vocabulary, EOS ids)."""

    def __init__(self, config: EngineConfig, source, runner: StepRunner):
        self.config, self.source, self.runner = config, source, runner
        self.tokenizer = source.tokenizer
        self.max_model_len = config.scheduler.max_model_len
        self.kv_manager = KVCacheManager(kv_group_specs(runner.groups), num_blocks=runner.num_blocks,
                                         num_state_slots=runner.num_state_slots)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager)
        self.outputs = OutputProcessor(self.tokenizer)
        self.eos_token_ids = eos_token_ids(source)
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []  # final outputs of aborts, returned by the next step

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request; raises ValueError (naming the field and value) if it is invalid."""
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        if self.scheduler.get_request(request_id) is not None:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self._validate_prompt(ids)
        req = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len)
        self.outputs.add(req, text)
        try:
            self.scheduler.add_request(req)  # refuses what the cache can never hold
        except BaseException:
            self.outputs.drop(request_id)
            raise
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Abort at any point; the request's final output ("abort") comes with the next step()."""
        req = self.scheduler.get_request(request_id)
        if req is None or not self.scheduler.abort_request(request_id):
            return False
        out = self.outputs.abort(req)
        if out is not None:
            self._aborted.append(out)
        self.runner.release([request_id])
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output (with deltas) for every request that changed."""
        plan = self.scheduler.schedule()
        output = self.runner.execute(plan)
        updated = self.scheduler.update(plan, output)
        results = [self._process(req, output.samples.get(req.request_id)) for req in updated]
        self.runner.release([req.request_id for req in updated if req.is_finished])
        aborted, self._aborted = self._aborted, []
        return aborted + results

    def _process(self, req: Request, sample) -> RequestOutput:
        stop = self.outputs.update(req, sample)
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

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len} "
                             f"(the prompt plus at least one output token must fit)")
        vocab = self.source.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")


def eos_token_ids(source) -> frozenset[int]:
    ids = set()
    for value in (getattr(source.hf_config, "eos_token_id", None), getattr(source.tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def kv_group_specs(groups) -> tuple:
    """The runner's cache groups as the block manager sees them (sizes only, no tensors)."""
    return tuple(RingGroupSpec(g.name, g.rows_per_unit) if g.is_ring
                 else PagedGroupSpec(g.name, g.rows_per_unit, g.compress_ratio) for g in groups)
