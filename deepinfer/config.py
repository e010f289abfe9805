"""Engine configuration: small validated dataclasses. Pure Python (no torch).

The environment knobs are read once, into `EngineConfig.env`; nothing below reads os.environ.

Every bad value raises ValueError naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from deepinfer.chat_template import resolve_chat_template
from deepinfer.environ import Environ, get_environ

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "int8")  # rows in the compute dtype, in bf16, MXFP8, or q8 (CPU)
# auto: Triton kernels on CUDA (where installed and the model is covered), else the torch reference
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")  # auto: the checkpoint's weights; dummy: config.json only, seeded random weights
POOLING_TYPES = ("last", "mean", "cls")  # an embedding: the last token's row, the mean of all rows, or the first
POOLING_CHOICES = ("auto",) + POOLING_TYPES  # auto: what the checkpoint declares (engine/pooling.py)
SCHEDULING_POLICIES = ("fcfs", "priority")  # how the scheduler orders waiting requests
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str | int, field: str = "size") -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"{field}: cannot parse size {text!r} (use e.g. 512MiB, 2GiB, 1000000)")
    unit = (m.group(2) or "").upper().removesuffix("B")
    return int(float(m.group(1)) * _UNITS[unit])


def _positive(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")


QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")
ACTIVATION_LEVELS = ("auto", "1", "2")  # int8 levels of a quantized matmul's activations on the CPU


def check_quantization(value) -> str:
    """`value` if it is one of QUANTIZATIONS; else ValueError naming quantization and the value."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(map(repr, QUANTIZATIONS))}, got {value!r}")
    return value


def check_load_format(value) -> str:
    """`value` if it is one of LOAD_FORMATS; else ValueError naming load_format and the value."""
    if value not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(map(repr, LOAD_FORMATS))}, got {value!r}")
    return value


@dataclass
class SchedulerConfig:
    """What the scheduler may put in one step. (How long a request may grow is
    `EngineConfig.max_model_len`, resolved once before the model is built.)"""

    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decodes)
    # fcfs: arrival order; priority: (priority, arrival), lower first (engine/request_queue.py)
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        for name, value in (("max_num_seqs", self.max_num_seqs),
                            ("max_num_batched_tokens", self.max_num_batched_tokens)):
            _positive(name, value)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(map(repr, SCHEDULING_POLICIES))}, "
                             f"got {self.scheduling_policy!r}")


@dataclass
class CacheConfig:
    """How the KV cache is sized and stored: blocks, bytes and row format. (The draft allowance k
    that sliding-window rings keep room for is `SpeculativeConfig.num_speculative_tokens`.)"""

    block_size: int = 16  # tokens per paged block
    num_blocks: int | None = None  # paged blocks; None: derived from kv_cache_memory
    # bytes for the KV cache when num_blocks is None; "auto": what max_num_seqs requests at max_model_len
    # need, at most gpu_memory_utilization of the memory free after the weights
    kv_cache_memory: int | str = "auto"
    gpu_memory_utilization: float = 0.9  # auto sizing's cap: this fraction of free memory (CPU or GPU)
    kv_cache_dtype: str = "auto"  # "auto" (the compute dtype), "bfloat16" (bf16 rows) or "fp8" (MXFP8 rows)
    enable_prefix_caching: bool = True  # reuse computed blocks of identical prefixes
    kv_cache_dir: str | None = None  # save computed blocks here; a later start-up reads them
    kv_cache_dir_size: int | str = "4GiB"  # the directory's budget (least recently used go first)
    prefix_snapshot_interval: int = 512  # ring models: tokens between snapshots of a long prefill
    num_prefix_snapshots: int | None = None  # ring models: snapshot slots; None: min(16, max_num_seqs)

    def __post_init__(self):
        _positive("block_size", self.block_size)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if self.kv_cache_dir is not None and (not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir):
            raise ValueError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
        self.kv_cache_dir_size = parse_size(self.kv_cache_dir_size, "kv_cache_dir_size")
        _positive("kv_cache_dir_size", self.kv_cache_dir_size)
        _positive("prefix_snapshot_interval", self.prefix_snapshot_interval)
        if self.num_prefix_snapshots is not None and (isinstance(self.num_prefix_snapshots, bool) or not isinstance(
                self.num_prefix_snapshots, int) or self.num_prefix_snapshots < 0):
            raise ValueError(f"num_prefix_snapshots must be an integer >= 0, got {self.num_prefix_snapshots!r}")
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if not self.auto_sized:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
            _positive("kv_cache_memory", self.kv_cache_memory)
        fraction = self.gpu_memory_utilization
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {fraction!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                             f"got {self.kv_cache_dtype!r}")

    @property
    def auto_sized(self) -> bool:
        """The cache is sized from the need (kv_cache_memory "auto", no num_blocks)."""
        return isinstance(self.kv_cache_memory, str) and self.kv_cache_memory.strip().lower() == "auto"


# prompt lookup (any model); DeepSeek-V4's next-n module; a smaller model with the same tokenizer (`model`)
SPECULATIVE_METHODS = ("ngram", "mtp", "draft_model")
DRAFT_LENGTHS = ("adaptive", "fixed")
MAX_SPECULATIVE_TOKENS = 32  # drafts one verification step may carry: each costs a query row every step


@dataclass
class SpeculativeConfig:
    """Speculative decoding: who drafts (`method`; None: nobody) and how many tokens a step may
    verify (k). k is also the ring allowance: rings keep S = W + max(backtracking, k + 1) rows.

    k = None resolves to DEEPINFER_USE_NEXTN_DECODE (5) in `EngineConfig`. A draft `model` (a path
    the engine loads) implies method "draft_model".
    """

    method: str | None = None  # None, "ngram", "mtp" or "draft_model"
    num_speculative_tokens: int | None = None  # k; None: DEEPINFER_USE_NEXTN_DECODE
    prompt_lookup_max: int = 4  # ngram: longest suffix matched against the history
    prompt_lookup_min: int = 1  # ngram: shortest
    model: str | None = None  # draft_model: the draft checkpoint (GGUF file or HF directory), same tokenizer
    draft_length: str = "adaptive"  # "fixed": k drafts a step; "adaptive": as many as pay (spec_decode/draft_length.py)
    row_cost: float = 0.15  # adaptive: one more verification row, as a share of a decode step

    def __post_init__(self):
        self._check_model()
        if self.draft_length not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_draft_length must be one of {', '.join(map(repr, DRAFT_LENGTHS))}, "
                             f"got {self.draft_length!r}")
        if isinstance(self.row_cost, bool) or not isinstance(self.row_cost, (int, float)) \
                or not 0.0 <= self.row_cost <= 1.0:
            raise ValueError(f"speculative_row_cost must be a number in [0, 1], got {self.row_cost!r}")
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))} "
                             f"or None, got {self.method!r}")
        k = self.num_speculative_tokens
        low = 1 if self.method else 0
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not low <= k <= MAX_SPECULATIVE_TOKENS):
            what = f"with speculative_method={self.method!r}" if self.method else "(the ring allowance)"
            raise ValueError(f"num_speculative_tokens must be an integer in [{low}, {MAX_SPECULATIVE_TOKENS}] "
                             f"{what}, got {k!r}")
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must not exceed "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    def _check_model(self) -> None:
        """A draft model path implies method "draft_model"; that method needs one, and no other takes one."""
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_model must be a path to a checkpoint, got {self.model!r}")
        if self.model is not None and self.method is None:
            self.method = "draft_model"
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_method='draft_model' needs speculative_model (a draft checkpoint), got None")
        if self.model is not None and self.method != "draft_model":
            raise ValueError(f"speculative_model={self.model!r} drafts with speculative_method='draft_model', "
                             f"got speculative_method={self.method!r}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass
class LoRAConfig:
    """Multi-LoRA serving: adapters a request may name (`LoRARequest`), applied beside the base
    layers. `max_loras` adapters are resident at once (device slots; a request whose adapter cannot
    get one waits); `max_lora_rank` is the largest rank a slot holds (smaller ranks are padded)."""

    enable_lora: bool = False
    max_loras: int = 1  # adapters resident at once
    max_lora_rank: int = 64  # the largest adapter rank accepted

    def __post_init__(self):
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        _positive("max_loras", self.max_loras)
        _positive("max_lora_rank", self.max_lora_rank)


@dataclass
class EngineConfig:
    """Everything one engine is built from: the model, dtype and device, the scheduler and cache
    configs, and the DEEPINFER_* knobs (`env`), read once here at start-up."""

    model: str | None = None  # a model directory or .gguf file; None: the embedded default model
    dtype: str = "auto"  # auto: on CPU fp32 or bf16 by a start-up measurement; bf16 on GPU
    # auto: a GGUF's quantized matrices stay quantized on a CPU with the kernels; none: dequantized
    # (the reference path); gguf: stay quantized (required); int8/int4: quantize linear layers at load
    quantization: str = "auto"
    # the int8 levels of quantized matmuls' activations on the CPU (~8 bits each value with one, ~15
    # with two): auto, two on q/k/v, one on o/gate/up/down and the LM head (layers/quant_linear.py);
    # "2" everywhere: closest to the fp32 forward; "1" everywhere: llama.cpp's Q8 activations
    activation_levels: str = "auto"
    device: str | None = None  # None/auto: cuda if available, else cpu
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (worker/cuda_graphs.py)
    seed: int = 0
    num_threads: int | None = None  # CPU threads per rank for the model's kernels; None: torch's default
    # prompt + output tokens of one request. None (not given): resolved before the model is built to the
    # model's context, or the longest request the KV cache holds (`with_max_model_len`, worker/context_length.py)
    max_model_len: int | None = None
    hf_overrides: dict | None = None  # config fields to override, e.g. {"sliding_window": 128}
    load_format: str = "auto"  # one of LOAD_FORMATS
    pooling: str = "auto"  # embeddings: one of POOLING_CHOICES (auto: the checkpoint's declaration)
    revision: str | None = None  # a hub model's branch, tag or commit (None: the default branch)
    # llama.cpp's vision file for a .gguf language model (`--mmproj`, loader/mmproj_source.py); None: none
    mmproj: str | None = None
    allow_long_max_model_len: bool = False  # accept max_model_len beyond the model's context (also the env knob)
    tensor_parallel_size: int = 1  # ranks (processes, one device each) splitting every layer; 1: no processes
    expert_parallel_size: int = 1  # ranks splitting MoE experts (DeepSeek-V4): 1 <= ep <= tp, tp % ep == 0
    # a chat template replacing the model's own: Jinja text, or a path to a file (resolved to its text here)
    chat_template: str | None = None
    scheduler: SchedulerConfig | None = None
    cache: CacheConfig | None = None
    speculative: SpeculativeConfig | None = None  # None: no drafts (rings still keep the env's allowance)
    lora: LoRAConfig | None = None  # None: LoRA off
    env: Environ | None = None  # None: the process environment (read once)

    def __post_init__(self):
        self.scheduler = self.scheduler or SchedulerConfig()
        self.cache = self.cache or CacheConfig()
        self.speculative = self.speculative or SpeculativeConfig()
        self.lora = self.lora or LoRAConfig()
        self.env = self.env or get_environ()
        if self.speculative.num_speculative_tokens is None:  # one value sizes rings and caps drafts
            self.speculative.num_speculative_tokens = self.env.use_nextn_decode
            self.speculative.__post_init__()  # e.g. DEEPINFER_USE_NEXTN_DECODE=0 with a method
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {self.enforce_eager!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        check_load_format(self.load_format)
        if self.pooling not in POOLING_CHOICES:
            raise ValueError(f"pooling must be one of {', '.join(map(repr, POOLING_CHOICES))}, got {self.pooling!r}")
        check_quantization(self.quantization)
        self.activation_levels = str(self.activation_levels)  # 1 / 2 from Python, "1" / "2" from the CLI
        if self.activation_levels not in ACTIVATION_LEVELS:
            raise ValueError(f"activation_levels must be one of {', '.join(map(repr, ACTIVATION_LEVELS))}, "
                             f"got {self.activation_levels!r}")
        self._check_parallel()
        if self.chat_template is not None:
            self.chat_template = resolve_chat_template(self.chat_template)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, "
                             f"got {self.attention_backend!r}")

    def _check_parallel(self) -> None:
        """tensor_parallel_size / expert_parallel_size, and what a multi-rank run cannot do yet. Whether
        the model splits its experts (ep > 1: DeepSeek-V4 only) is checked where it is built
        (model_loader.check_expert_parallel)."""
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        _positive("tensor_parallel_size", tp)
        _positive("expert_parallel_size", ep)
        if ep > tp or tp % ep:
            raise ValueError(f"expert_parallel_size={ep} must divide tensor_parallel_size={tp} (1 <= ep <= tp)")
        if tp > 1 and self.mmproj is not None:
            raise ValueError(f"mmproj={self.mmproj!r}: a vision tower is not split over ranks; "
                             f"tensor_parallel_size must be 1, got {tp}")
        if tp == 1:
            return

    def __setattr__(self, name: str, value) -> None:
        """max_model_len is set once, by the constructor: the engine resolves it into a new config
        (`with_max_model_len`) before any model is built, and nothing changes it afterwards."""
        if name == "max_model_len" and name in self.__dict__:
            raise AttributeError(f"max_model_len is {self.max_model_len!r} for this config's life; make a config "
                                 f"with another one (EngineConfig.with_max_model_len)")
        super().__setattr__(name, value)

    def given_max_model_len(self, model_context: int) -> int | None:
        """max_model_len as given (None: not given, the engine resolves it). One beyond the model's
        context is refused unless allow_long_max_model_len (or DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1)
        says to accept it: positions past what the model was trained on give garbage."""
        allowed = self.allow_long_max_model_len or self.env.allow_long_max_model_len
        if self.max_model_len is not None and self.max_model_len > model_context and not allowed:
            raise ValueError(f"max_model_len {self.max_model_len:,} exceeds the model's context of "
                             f"{model_context:,} tokens; lower it, or pass --allow-long-max-model-len "
                             f"(DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1) to accept it anyway")
        return self.max_model_len

    def with_max_model_len(self, length: int) -> EngineConfig:
        """A copy of this config with max_model_len resolved to `length`: the config every model, the
        cache and the scheduler are built from (`worker/context_length.py` makes it once; nothing
        writes the value afterwards)."""
        return dataclasses.replace(self, max_model_len=length)
