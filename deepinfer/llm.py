"""The offline API: LLM(model=None).generate(prompts, params), .chat(messages), .stream(prompt)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from deepinfer.compose import build_engine
from deepinfer.contracts.lora import LoRARequest
from deepinfer.contracts.pooling import PoolingParams
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.llm_options import init_signature, llm_engine_args
from deepinfer.outputs import EmbeddingRequestOutput, RequestOutput
from deepinfer.sampling_params import SamplingParams, model_sampling_defaults, short_repr

# a prompt: text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids}, with an optional
# "cache_salt" and "pictures" (PictureInputs, processed for the model, at their runs in the prompt)
Prompt = str | list[int] | Mapping
_PROMPT_KEYS = ("prompt", "prompt_token_ids")
_DICT_KEYS = frozenset(_PROMPT_KEYS) | {"cache_salt", "pictures"}
ParsedPrompt = tuple  # (text or token ids, cache_salt, pictures)


class LLM:
    """An engine for offline use. `model=None` runs the embedded default model (SmolLM2-135M).
    The keywords are the fields of `EngineArgs` (`deepinfer/engine_args.py` gives each one's type,
    default and meaning; the CLI's engine flags are the same options), plus vLLM's below.

    `speculative_method="ngram"` (prompt lookup, any model), `"mtp"` (DeepSeek-V4's next-n
    module) or `speculative_model=PATH` (a smaller checkpoint with the same tokenizer) drafts up to
    `num_speculative_tokens` tokens per step, verified by the model in one pass; outputs keep the
    distribution of plain decoding (greedy: the same tokens).

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

    The KV cache is sized for `max_num_seqs` requests at `max_model_len` (`kv_cache_memory="auto"`),
    at most `gpu_memory_utilization` of the memory free after the weights (CPU or GPU); an explicit
    `kv_cache_memory` ("2GiB") or `num_blocks` fixes it. A cache that cannot hold one request at
    max_model_len is refused, and so is a max_model_len beyond the model's context unless
    `allow_long_max_model_len=True`.

    On CUDA with the Triton attention backend, decode-only steps replay CUDA graphs captured at
    start-up for batch sizes up to min(max_num_seqs, 256) (`worker/cuda_graphs.py`);
    `enforce_eager=True` (vLLM's keyword) runs every step eagerly.

    `tensor_parallel_size=N` > 1 splits the model over N ranks: this process is rank 0 (it
    schedules and samples) and starts N - 1 worker processes, one device each (`worker/multiproc.py`);
    outputs equal one rank's up to float rounding. `close()` (or leaving `with`, or `del llm` and
    garbage collection, or the end of the process) stops them and leaves their process group, so
    the next multi-rank LLM can start in this process; two cannot be open at once (RuntimeError).
    For DeepSeek-V4, `expert_parallel_size=E` (dividing N) gives each rank n_routed_experts / E
    experts; activations stay whole on every rank and the partial outputs are summed. Under
    `torchrun`, N is its WORLD_SIZE and rank 0 runs the script (`worker/torchrun.py`).

    vLLM's keywords are taken where they mean something here: `pipeline_parallel_size` (only 1),
    `trust_remote_code` (accepted; no code from a checkpoint is ever run: every architecture is
    DeepInfer's own), `tokenizer` (only the model's own), `swap_space`,
    `disable_log_stats` and `tokenizer_mode="auto"` (accepted, no effect: see `llm_options`).
    Any other keyword raises TypeError, before anything loads, naming the closest accepted ones.
    """

    def __init__(self, model: str | None = None, **kwargs):
        self.engine = build_engine(llm_engine_args(model, kwargs).create_engine_config())

    @property
    def engine(self) -> LLMEngine:
        """The engine; RuntimeError once this LLM is closed."""
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise RuntimeError("this LLM is closed (by close() or the end of its `with` block); "
                               "create a new LLM(...) to generate again")
        return engine

    @engine.setter
    def engine(self, engine: LLMEngine) -> None:
        self._engine = engine

    def close(self) -> None:
        """Release the engine: save what the KV cache directory still lacks, stop the tensor-parallel
        worker processes and leave their process group, and drop the model and its KV cache (freed
        once nothing else holds them). Idempotent; `with LLM(...) as llm:` closes at the end of the
        block. An LLM dropped without close() (`del llm`, then garbage collection) or still open at
        exit is released the same way (`LLMEngine.close`). A closed LLM raises RuntimeError when used."""
        engine = self.__dict__.pop("_engine", None)
        if engine is not None:
            engine.close()

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

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling the model's authors suggest: the checkpoint's generation config (temperature,
        top_p, top_k, min_p, repetition_penalty; `do_sample: false` means greedy; max_new_tokens
        becomes max_tokens), the rest SamplingParams' defaults. A checkpoint that names none of
        these (GGUF files never do) gets FALLBACK_SAMPLING: greedy decoding makes small models loop.
        ValueError naming the field and the value when the config holds a value we refuse."""
        config = self.engine.source.generation_config
        try:
            return SamplingParams(**model_sampling_defaults(config))
        except ValueError as exc:
            raise ValueError(f"generation config of {self.engine.source.path!r}: {exc}") from None

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (`priority`: one per prompt, lower first, needs
        scheduling_policy="priority" unless all 0); outputs come back in prompt order, one per prompt,
        whose `outputs` hold its `n` samples (index 0..n-1; with `best_of`, the n of highest
        cumulative logprob, best first). The samples of a prompt compute it once.

        A prompt is a string, a list of token ids, or a dict: `{"prompt": str}` or
        `{"prompt_token_ids": [int, ...]}`, either with an optional `"cache_salt": str` (only
        requests with the same salt share cached prefixes) and, for a model that takes pictures,
        `"pictures"`: `PictureInput`s (contracts/multimodal.py) whose placeholder runs the prompt holds.

        `sampling_params=None` takes the model's defaults (`get_default_sampling_params`), as `chat`,
        the CLI and the server do.

        `lora_request` (with `enable_lora=True`): a `LoRARequest(name, int_id, path)` for every prompt,
        or a list with one per prompt (None: the base model). Requests with different adapters and
        without one run in the same steps; see docs/lora.md.

        A prompt that cannot run raises ValueError naming its index (`prompts[i]: ...`) before any
        step runs, as the server answers 400: a malformed prompt (not a string, a list of ints or such
        a dict; a dict with a missing or unknown key), an empty one, one whose prompt plus
        `max_tokens` exceeds max_model_len, token ids outside the vocabulary, bad sampling params.
        A request failed by a fault while it ran gets its output with finish_reason "error" and
        `error` set; the rest of the batch still runs. When a fatal fault (or KeyboardInterrupt)
        ends the call, its requests are aborted first.
        """
        prompts = parse_prompts(prompts)  # malformed ones raise here, before anything runs
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        priorities = _as_params_list(0 if priority is None else priority, len(prompts), "priority")
        return self._generate_parsed(prompts, params, loras, priorities, use_tqdm)

    def _generate_parsed(self, prompts, params, loras, priorities, use_tqdm) -> list[RequestOutput]:
        """Run parsed prompts (text or ids, cache_salt, pictures) to completion, in order."""
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        try:
            for i, (prompt, p, lora, prio) in enumerate(zip(prompts, params, loras, priorities, strict=True)):
                order.append(self._add(i, prompt, p, lora, priority=prio))
            self._run_to_completion(set(order), results, use_tqdm)
        finally:  # after any exception (a fatal fault, KeyboardInterrupt) nothing of ours stays queued
            self._abort_unfinished(order)
        return [results[rid] for rid in order]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order: `out.outputs.embedding` (a list of floats).

        Prompts take the forms `generate` takes. Each is computed like a prefill (chunked as the
        token budget says, batched with whatever else runs) and pooled as the model declares
        (`self.engine.pooling`: a sentence-transformers checkpoint's Pooling and Normalize modules, or a
        GGUF file's pooling_type; `LLM(..., pooling=...)` names or overrides the type). A model that
        declares none (a generative one) embeds only with `pooling=`: else ValueError saying so.
        `pooling_params` may ask for `dimensions` (Matryoshka models) and `normalize`;
        `truncate_prompt_tokens` keeps each prompt's last k tokens (-1: max_model_len).

        A prompt that cannot run (empty, longer than max_model_len, ids outside the vocabulary,
        `dimensions` the model does not allow) raises ValueError naming its index before any step;
        a request failed by a fault while it ran comes back with finish_reason "error" and `error`."""
        params = PoolingParams() if pooling_params is None else pooling_params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        prompts = parse_prompts(prompts)
        results: dict[str, EmbeddingRequestOutput] = {}
        order: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                order.append(self._add(i, prompt, params))
            self._run_to_completion(set(order), results, use_tqdm)
        finally:
            self._abort_unfinished(order)
        return [results[rid] for rid in order]

    def _run_to_completion(self, mine: set[str], results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        from tqdm.auto import tqdm  # imported when a batch first runs: not on the start-up path

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
             add_generation_prompt: bool = True, *, tools: list[dict] | None = None, tool_choice=None,
             parallel_tool_calls: bool | None = None, tool_call_parser: str = "auto",
             reasoning_parser: str | None = None, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        `tools` (OpenAI's function tools) reach the template, and each answer's calls are parsed into
        `outputs[i].tool_calls` (`deepinfer.outputs.ToolCall`; the format is the template's, or
        `tool_call_parser`'s: hermes, llama3_json, mistral, deepseek_v3); `tool_choice` "required" or
        {"type": "function", "function": {"name": ...}} forces a call whose arguments match the
        function's schema. `reasoning_parser` (deepseek_r1, qwen3) puts a <think> section into
        `reasoning_content`. `text` stays the whole answer. As the server's chat route does.
        `lora_request` as in `generate`: one, or one per conversation.
        A vision model reads pictures in a message's content parts: `{"type": "image", "image": PIL
        image | path}`, `{"type": "image_url", "image_url": {"url": data URL | path}}` (docs/pictures.md)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        from deepinfer.serving.offline_chat import attach_parsed, prepare_offline_chat, with_pictures

        pictured = with_pictures(conversations)
        if not pictured and tools is None and tool_choice is None and reasoning_parser is None \
                and chat_template_kwargs is None:
            prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
            return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        params = _as_params_list(sampling_params if sampling_params is not None
                                 else self.get_default_sampling_params(), len(conversations))
        prompts, params, plans, pictures = prepare_offline_chat(
            self.engine.tokenizer, conversations, params, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser, chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt, vision=self._vision() if pictured else None)
        pictures = pictures or [()] * len(prompts)
        parsed = [(p, None, tuple(pics or ())) for p, pics in zip(prompts, pictures, strict=True)]
        outputs = self._generate_parsed(parsed, params, _as_lora_list(lora_request, len(prompts)), [0] * len(prompts),
                                        use_tqdm)
        attach_parsed(outputs, plans)
        return outputs

    def _vision(self):
        """The model's picture preprocessing (`serving/vision.py`), loaded once; None for a text model."""
        if not hasattr(self, "_vision_processor"):
            from deepinfer.serving.context import vision_processor

            self._vision_processor = vision_processor(self.engine.source, self.engine.tokenizer)
        return self._vision_processor

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        tok = self.engine.tokenizer
        if not tok.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a prompt, or give "
                             "one with LLM(..., chat_template=TEXT_OR_FILE)")
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # a dict or transformers' BatchEncoding

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None, priority: int = 0) -> Iterator[RequestOutput]:
        """Yield one request's outputs step by step (`outputs[0].delta_text` is the new text).
        `prompt` is one prompt in any form `generate` takes. With `n` > 1, `outputs` holds every
        sample (`index` 0..n-1), each with its own delta; with `best_of` > n, one final output."""
        inputs, cache_salt, pictures = parse_prompt(prompt)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        request_id = self.engine.add_request(inputs, params, cache_salt=cache_salt, lora_request=lora_request,
                                             priority=priority, pictures=pictures)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(request_id)

    def _add(self, index: int, prompt, params, lora_request: LoRARequest | None = None, **scheduling) -> str:
        """Queue one parsed prompt (text or ids, cache_salt, pictures); ValueError `prompts[index]: ...`
        when the engine refuses it (the caller aborts what it queued before)."""
        inputs, cache_salt, pictures = prompt
        if pictures:
            scheduling["pictures"] = pictures
        try:
            return self.engine.add_request(inputs, params, cache_salt=cache_salt, lora_request=lora_request,
                                           **scheduling)
        except ValueError as exc:
            raise ValueError(f"prompts[{index}]: {exc}") from None


LLM.__init__.__signature__ = init_signature(LLM.__init__)  # inspect and help() list every keyword

def parse_prompts(prompts) -> list[ParsedPrompt]:
    """(text or token ids, cache_salt, pictures) of each prompt: one prompt (a string, a list of token ids
    or a dict) or a list of them. ValueError naming the index, the field and the value of the
    first malformed one."""
    prompts = _as_prompt_list(prompts)
    parsed = []
    for i, prompt in enumerate(prompts):
        try:
            parsed.append(parse_prompt(prompt))
        except ValueError as exc:
            raise ValueError(f"prompts[{i}]: {exc}") from None
    return parsed


def parse_prompt(prompt) -> ParsedPrompt:
    """(text or token ids, cache_salt, pictures) of one prompt: a string, a list of ints, or a dict
    with exactly one of "prompt" (a string) and "prompt_token_ids" (a list of ints), and optionally
    "cache_salt" and "pictures" (a sequence of PictureInput). ValueError naming the field and the
    value otherwise (the engine checks the salt's type, the length, the ids' range and the pictures'
    runs)."""
    if not isinstance(prompt, Mapping):
        return _checked_input("prompt", prompt), None, ()
    unknown = sorted(map(str, set(prompt) - _DICT_KEYS))
    if unknown:
        raise ValueError(f"prompt dict has unknown key{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(map(repr, unknown))}; allowed: 'prompt' or 'prompt_token_ids', "
                         f"'cache_salt' and 'pictures'")
    given = [key for key in _PROMPT_KEYS if key in prompt]
    if len(given) != 1:
        what = "neither" if not given else "both"
        raise ValueError(f"prompt dict must have exactly one of 'prompt' (text) and 'prompt_token_ids' "
                         f"(token ids), got {what}: {short_repr(dict(prompt))}")
    key = given[0]
    value = prompt[key]
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"prompt must be a string, got {short_repr(value)}")
    if key == "prompt_token_ids" and not _is_id_list(value):
        raise ValueError(f"prompt_token_ids must be a list of token ids (ints), got {short_repr(value)}")
    pictures = prompt.get("pictures") or ()
    if not isinstance(pictures, (list, tuple)):
        raise ValueError(f"pictures must be a list of PictureInput, got {short_repr(pictures)}")
    return (value if key == "prompt" else list(value)), prompt.get("cache_salt"), tuple(pictures)


def _checked_input(field: str, value) -> str | list[int]:
    if isinstance(value, str):
        return value
    if _is_id_list(value):
        return list(value)
    raise ValueError(f"{field} must be a string, a list of token ids (ints) or a dict with 'prompt' or "
                     f"'prompt_token_ids', got {short_repr(value)}")


def _is_id_list(value) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _as_prompt_list(prompts) -> list:
    """One prompt (text, token ids or a dict) as a list of one; a sequence of prompts as a list."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {short_repr(prompts)}")
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int) and not isinstance(prompts[0], bool):
        return [prompts]
    return prompts


def _as_lora_list(lora_request, n: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) for every prompt, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, "
                         f"got {short_repr(lora_request)}")
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request has {len(loras)} entries for {n} prompts")
    bad = next((x for x in loras if x is not None and not isinstance(x, LoRARequest)), None)
    if bad is not None:
        raise ValueError(f"lora_request entries must be LoRARequest or None, got {short_repr(bad)}")
    return loras


def _as_params_list(params, n: int, field: str = "sampling_params") -> list:
    if isinstance(params, (SamplingParams, int)):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{field} has {len(params)} entries for {n} prompts")
    return params
