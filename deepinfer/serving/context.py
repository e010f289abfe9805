"""What every step of a request's life reads: the serving settings and the one `ServingContext` of a
server (engine loop, tokenizer pool, bounds, grammars, defaults, served models, tenants, seats).

The HTTP layer builds one per app (`entrypoints/openai/server.py`) and hands it to every route; the
lifecycle's steps (parse, prepare, admit, run) take it as their first argument.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.sampling_params import SamplingParams, model_sampling_defaults
from deepinfer.serving.admission import ClientSeats, PriorityRange, PromptBounds
from deepinfer.serving.chat.prompt import ChatSetup
from deepinfer.serving.chat.reasoning import make_reasoning_parser
from deepinfer.serving.chat.tool_parsers import make_tool_parser
from deepinfer.serving.engine_loop import EngineLoop
from deepinfer.serving.errors import ServingError, service_unavailable, too_busy
from deepinfer.serving.metrics import ServerMetrics
from deepinfer.serving.models import ServedAdapters, model_not_found
from deepinfer.serving.pictures import (
    MAX_PICTURE_PIXELS,
    MAX_PICTURES_PER_REQUEST,
    MediaPolicy,
    set_decoder_guard,
)
from deepinfer.serving.pool import TokenizerPool
from deepinfer.serving.store import ResponseStore
from deepinfer.serving.tenancy import Credentials
from deepinfer.serving.vision import VisionProcessor
from deepinfer.structured_output import GrammarCompiler


@dataclass
class ServerSettings:
    """What `deepinfer serve` adds to the engine's own configuration."""

    model_name: str
    api_key: str | None = None  # accepted client keys, comma-separated (None: no key checked)
    admin_api_key: str | None = None  # operator keys: every route, every tenant's data, any priority
    max_waiting: int = 256  # waiting requests above this get a 429
    max_body_bytes: int = 8 << 20
    retry_after_s: int = 1
    tokenizer_workers: int = 2  # threads that parse, tokenize and chat-template request bodies
    max_requests_per_client: int | None = None  # seats per client; None: max_num_seqs + max_waiting // 2
    priority_range: PriorityRange = field(default_factory=PriorityRange)  # what clients may send
    shared_prefix_cache: bool = False  # True: tenants (API keys) may hit each other's cached prefixes
    tool_call_parser: str = "auto"  # the tool-call format (tool_parsers: auto = the chat template's)
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: <think> sections -> reasoning_content
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of the LoRA adapters served from the start
    allow_runtime_lora_updating: bool = False  # the load / unload adapter routes
    lora_dirs: tuple[str, ...] = ()  # the only directories the load route reads adapters from
    data_parallel_secret: str | None = None  # a replica's cluster secret: believe x-deepinfer-client beside it
    allowed_media_dir: str | None = None  # file:// pictures are read only below it (None: refused)
    allow_remote_media: bool = False  # http(s) pictures are fetched (off: a server reaching its own network)
    max_picture_pixels: int = MAX_PICTURE_PIXELS  # width * height of one picture, checked before decoding
    max_pictures_per_request: int = MAX_PICTURES_PER_REQUEST

    def media_policy(self) -> MediaPolicy:
        return MediaPolicy(self.allowed_media_dir, self.allow_remote_media, self.max_picture_pixels,
                           self.max_pictures_per_request)


class ServingContext:
    """Everything a request's steps need: the engine loop, tokenizers of its own, settings, metrics."""

    def __init__(self, engine, settings: ServerSettings, metrics: ServerMetrics,
                 on_fatal: Callable[[BaseException], None] | None = None):
        self.settings, self.metrics = settings, metrics
        self.engine = engine  # read-only here: only the engine thread calls into it
        self.engine_loop = EngineLoop(engine, metrics, on_fatal=on_fatal)
        self.tokenizer = copy.deepcopy(engine.tokenizer)  # the engine thread keeps the original
        self.pool = TokenizerPool(self.tokenizer, max(1, settings.tokenizer_workers),
                                  retry_after_s=settings.retry_after_s)
        self.max_model_len = engine.max_model_len
        self.bounds = PromptBounds(self.tokenizer, self.max_model_len)
        self.seats = ClientSeats(settings.max_requests_per_client or (
            engine.config.scheduler.max_num_seqs + max(1, settings.max_waiting // 2)), settings.retry_after_s)
        self.credentials = Credentials(settings.api_key, settings.admin_api_key)
        self.vocab_size = engine.source.hf_config.vocab_size
        # compiles structured output in the pool threads, with a tokenizer copy of its own
        self.grammars = GrammarCompiler(copy.deepcopy(engine.tokenizer), self.vocab_size, engine.eos_token_ids)
        self.sampling_defaults = sampling_defaults(engine.source)
        self.created = int(time.time())
        set_decoder_guard(settings.max_picture_pixels)
        self.chat_setup = ChatSetup(make_tool_parser(settings.tool_call_parser, self.tokenizer),
                                    make_reasoning_parser(settings.reasoning_parser, self.tokenizer),
                                    vision_processor(engine.source, self.tokenizer), settings.media_policy())
        self.adapters = ServedAdapters(settings.model_name, engine.adapters, settings.lora_dirs)
        for name, path in settings.lora_modules:  # a bad adapter stops the start-up, naming it
            self.adapters.add(name, path)
        self.responses = ResponseStore()

    def check_capacity(self) -> None:
        """503 while shutting down, 429 while the waiting queue (incl. requests being tokenized) is full."""
        if not self.engine_loop.accepting:
            raise service_unavailable("the server is shutting down or its engine stopped; retry later")
        waiting, limit = self.engine_loop.num_waiting + self.pool.pending, self.settings.max_waiting
        if waiting >= limit:
            raise too_busy(f"the server is busy: {waiting} requests are waiting (limit {limit}); retry later",
                           self.settings.retry_after_s)

    def check_model(self, model: str | None) -> None:
        """A 404 naming `model` unless it is the served name or one of its adapters (None: the default)."""
        if model is not None and model != self.settings.model_name and self.adapters.get(model) is None:
            raise model_not_found(model, self.settings.model_name, bool(self.adapters.all()))

    def lora_request(self, model: str | None):
        """The LoRARequest of the adapter `model` names (None: the base model); 404 for an unknown name."""
        self.check_model(model)
        return self.adapters.get(model)

    def base_model_only(self, model: str | None, what: str) -> None:
        """A 400 naming `model` when it is an adapter: `what` (embeddings, scores...) come from the base."""
        if self.lora_request(model) is not None:
            raise ServingError(400, f"{model!r} is a LoRA adapter; {what} come from the base model only",
                               path="model")

    def response_model(self, model: str | None) -> str:
        """The model name an answer reports: the adapter's, else the served base name."""
        return model if self.adapters.get(model) is not None else self.settings.model_name


def sampling_defaults(source) -> dict:
    """What a request's unset sampling fields take: the checkpoint's generation config (as vLLM's
    `--generation-config auto`), else FALLBACK_SAMPLING, as everywhere (`model_sampling_defaults`).
    max_new_tokens is left out: an unset max_tokens runs to the context. ValueError naming the
    file's bad value at start-up."""
    defaults = model_sampling_defaults(source.generation_config)
    defaults.pop("max_tokens", None)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"generation config of {source.path!r}: {exc}") from None
    return defaults


def vision_processor(source, tokenizer) -> VisionProcessor | None:
    """The model's picture preprocessing (None: a text model, or a checkpoint that is not a folder); a GGUF
    language model with `--mmproj` has it from the vision file's keys."""
    if getattr(source, "vision", None) is not None:
        return VisionProcessor.from_mmproj(source.vision)
    path = getattr(source, "path", None)
    if not isinstance(path, str) or not os.path.isdir(path):
        return None
    return VisionProcessor.load(path, tokenizer)
