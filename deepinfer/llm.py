"""The offline API: LLM(model=None).generate(prompts, params), .chat(messages), .stream(prompt)."""

from __future__ import annotations

import atexit
from collections.abc import Iterator, Mapping, Sequence

from tqdm.auto import tqdm

from deepinfer.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.model_executor.loader import load_model_source
from deepinfer.outputs import CompletionOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams, short_repr
from deepinfer.worker.model_runner import ModelRunner

# a prompt: text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids}, with an optional "cache_salt"
Prompt = str | list[int] | Mapping
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_DICT_KEYS = frozenset(_PROMPT_KEYS) | {"cache_salt"}


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

    Prefix caching is on by default (`enable_prefix_caching=False` turns it off): a prompt that
    starts like an earlier one reuses the KV blocks already computed for the shared prefix
    (`RequestOutput.num_cached_tokens` says how many prompt tokens were not recomputed). Requests
    share cached prefixes only when their `cache_salt` is equal: pass a prompt as
    `{"prompt": text, "cache_salt": "tenant-a"}` (or `{"prompt_token_ids": ids, ...}`) to keep
    one user's cache apart from another's. Ring models (sliding window, DeepSeek-V4) also keep
    `num_prefix_snapshots` snapshots, taken every `prefix_snapshot_interval` tokens of a prefill.

    `kv_cache_dir` keeps a saved cache: computed blocks are written there (at most
    `kv_cache_dir_size`, least recently used files go first), and a later start-up of the same
    model reads them instead of recomputing. `close()` (or leaving `with LLM(...) as llm:`, or
    the end of the process) writes what the directory still lacks.
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", quantization: str = "auto",
                 device: str | None = None,
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
        config = EngineConfig(model=model, dtype=dtype, quantization=quantization, device=device, seed=seed,
                              max_model_len=max_model_len, scheduler=scheduler, cache=cache,
                              speculative=speculative, hf_overrides=hf_overrides, load_format=load_format)
        self.engine = build_engine(config)
        self._closed = False
        self._at_exit = bool(cache.kv_cache_dir and cache.enable_prefix_caching)  # only a cache dir needs it
        if self._at_exit:
            atexit.register(self.close)

    def close(self) -> None:
        """Save what the KV cache directory still lacks and stop its writer (idempotent; also
        called on exit and by `with LLM(...) as llm:`)."""
        if self._closed or self.engine is None:
            return
        self._closed = True
        if self._at_exit:
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

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is a string, a list of token ids, or a dict: `{"prompt": str}` or
        `{"prompt_token_ids": [int, ...]}`, either with an optional `"cache_salt": str` (only
        requests with the same salt share cached prefixes).

        A prompt the engine refuses (empty, too long, bad token ids, a malformed dict, bad sampling
        params) gets an output whose `error` holds the ValueError; a request failed by a fault
        while it ran gets its output with finish_reason "error" and `error` set. The rest of the
        batch still runs. When a fatal fault (or KeyboardInterrupt) ends the call, its requests
        are aborted first.
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
        """Queue one prompt; a refused one gets its finished output (`error` set) in `results`."""
        try:
            inputs, cache_salt = parse_prompt(prompt)
            return self.engine.add_request(inputs, params, cache_salt=cache_salt)
        except ValueError as exc:
            rid = f"refused-{len(results)}-{id(exc)}"
            done = CompletionOutput(index=0, finish_reason="error")
            text, ids = _refused_prompt(prompt)
            results[rid] = RequestOutput(rid, text, ids, [done], finished=True, error=exc)
            return rid


def parse_prompt(prompt) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache_salt) of one prompt; a dict must hold exactly one of "prompt"
    (a string) and "prompt_token_ids" (a list of ints), and may hold "cache_salt". ValueError
    naming the field and the value otherwise (the engine checks the salt's type and the ids)."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = sorted(map(str, set(prompt) - _DICT_KEYS))
    if unknown:
        raise ValueError(f"prompt dict has unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; allowed: 'prompt' or 'prompt_token_ids', "
                         f"and 'cache_salt'")
    given = [key for key in _PROMPT_KEYS if key in prompt]
    if len(given) != 1:
        what = "neither" if not given else "both"
        raise ValueError(f"prompt dict must have exactly one of 'prompt' (text) and 'prompt_token_ids' "
                         f"(token ids), got {what}: {short_repr(dict(prompt))}")
    key = given[0]
    value = prompt[key]
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt must be a string, got {short_repr(value)}")
    if key == "prompt_token_ids" and not (isinstance(value, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise ValueError(f"prompt_token_ids must be a list of token ids (ints), got {short_repr(value)}")
    return (value if key == "prompt" else list(value)), prompt.get("cache_salt")


def _refused_prompt(prompt) -> tuple[str | None, list[int]]:
    """(prompt text, prompt token ids) shown in a refused prompt's output, as far as they are known."""
    if isinstance(prompt, Mapping):
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if isinstance(prompt, str):
        return prompt, []
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    return None, []


def _as_prompt_list(prompts) -> list:
    """One prompt (text, token ids or a dict) as a list of one; a sequence of prompts as a list."""
    if isinstance(prompts, (str, Mapping)):
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
