"""The offline API: LLM(model=None).generate(prompts, params), .chat(messages), .stream(prompt)."""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

from deepinfer.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model_executor.loader import load_model_source
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.model_runner import ModelRunner


def build_engine(config: EngineConfig) -> LLMEngine:
    """Compose the system: load the model source, build the runner (model, caches, sampler) and
    hand both to the engine. The only place that knows every layer."""
    source = load_model_source(config.model, load_format=config.load_format)
    for key, value in (config.hf_overrides or {}).items():
        setattr(source.hf_config, key, value)
    config.resolve_max_model_len(getattr(source.hf_config, "max_position_embeddings", 4096))
    return LLMEngine(config, source, ModelRunner(source, config))


class LLM:
    """An engine for offline use. `model=None` runs the embedded default model (SmolLM2-135M).

    `speculative_method="ngram"` (prompt lookup, any model) or `"mtp"` (DeepSeek-V4's next-n
    module) drafts up to `num_speculative_tokens` tokens per step, verified by the model in one
    pass; outputs keep the distribution of plain decoding (greedy: the same tokens).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str | None = None,
                 max_model_len: int | None = None, kv_cache_memory: str | int = "1GiB",
                 num_blocks: int | None = None, block_size: int = 16, kv_cache_dtype: str = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, seed: int = 0,
                 speculative_method: str | None = None, num_speculative_tokens: int | None = None,
                 hf_overrides: dict | None = None, load_format: str = "auto",
                 enable_prefix_caching: bool = True, kv_cache_dir: str | None = None,
                 kv_cache_dir_size: str | int = "4GiB", prefix_snapshot_interval: int = 512,
                 num_prefix_snapshots: int | None = None):
        cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                            kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=enable_prefix_caching,
                            kv_cache_dir=kv_cache_dir, kv_cache_dir_size=kv_cache_dir_size,
                            prefix_snapshot_interval=prefix_snapshot_interval,
                            num_prefix_snapshots=num_prefix_snapshots)
        scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        speculative = SpeculativeConfig(speculative_method, num_speculative_tokens)
        config = EngineConfig(model=model, dtype=dtype, device=device, seed=seed,
                              max_model_len=max_model_len, scheduler=scheduler, cache=cache,
                              speculative=speculative, hf_overrides=hf_overrides, load_format=load_format)
        self.engine = build_engine(config)
        self._closed = False
        atexit.register(self.close)

    def close(self) -> None:
        """Save what the KV cache directory still lacks and stop its writer (idempotent; also
        called on exit and by `with LLM(...) as llm:`)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_metrics(self) -> dict:
        """The engine's counters since start: requests, tokens, preemptions and, with a
        speculative method, drafts proposed and accepted (see `LLMEngine.get_metrics`)."""
        return self.engine.get_metrics()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt the engine refuses (empty, too long, bad token ids, bad sampling params) gets an
        output whose `error` holds the ValueError; a request failed by a fault while it ran gets
        its output with finish_reason "error" and `error` set. The rest of the batch still runs.
        When a fatal fault (or KeyboardInterrupt) ends the call, its requests are aborted first.
        """
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                order.append(self._add(prompt, p, results))
            self._run_to_completion(set(order), results, use_tqdm)
        finally:  # after any exception (a fatal fault, KeyboardInterrupt) nothing of ours stays queued
            self._abort_unfinished(order)
        return [results[rid] for rid in order]

    def _run_to_completion(self, mine: set[str], results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        with tqdm(total=len(mine), desc="requests", disable=not use_tqdm, initial=len(results)) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in mine:
                        results[out.request_id] = out
                        bar.update(1)

    def _abort_unfinished(self, request_ids: list[str]) -> None:
        """Abort those of `request_ids` still in the engine, so their blocks return to the pool."""
        for request_id in request_ids:
            self.engine.abort_request(request_id)  # False (a no-op) for finished or refused ones

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        if not tok.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a prompt")
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield one request's outputs step by step (`outputs[0].delta_text` is the new text)."""
        request_id = self.engine.add_request(prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _add(self, prompt, params, results) -> str:
        try:
            return self.engine.add_request(prompt, params)
        except ValueError as exc:
            rid = f"refused-{len(results)}-{id(exc)}"
            done = CompletionOutput(index=0, finish_reason="error")
            results[rid] = RequestOutput(rid, prompt if isinstance(prompt, str) else None,
                                         [] if isinstance(prompt, str) else list(prompt), [done],
                                         finished=True, error=exc)
            return rid


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params
