"""EngineArgs: every engine option once, with its type, default, help and choices. Pure Python (no torch).

`LLM(model, **kwargs)` is `EngineArgs(model=model, **kwargs).create_engine_config()` (through
`llm_options`, which adds vLLM's keywords that have no option here); the CLI's engine flags are
generated from the same fields (`EngineArgs.add_cli_args`) and parsed back (`EngineArgs.from_cli_args`).

Each default is written once, in the config dataclass the option ends up in (config.py): a field
names that config and its field there (`_option`), and takes the default from it. Field names are
vLLM's where they mean the same thing; a flag is `--` plus the name in kebab case unless it says
otherwise (`--threads` for num_threads).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass

from deepinfer.config import (
    ACTIVATION_LEVELS,
    ATTENTION_BACKENDS,
    DRAFT_LENGTHS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    POOLING_CHOICES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

PREFIX = "prefix caching"  # the argument group of the prefix-caching flags; the rest are "engine"
LORA = "LoRA adapters"  # the argument group of the LoRA flags


def _option(config: type, name: str, help: str, *, flag: str | None = None, metavar: str | None = None,
            choices: tuple[str, ...] | None = None, group: str = "engine", aliases: tuple[str, ...] = ()):
    """A field of EngineArgs that sets `config`'s field `name` and takes its default from there
    (`aliases`: more flags for it, e.g. llama.cpp's name)."""
    default = config.__dataclass_fields__[name].default
    if default is dataclasses.MISSING:
        raise TypeError(f"{config.__name__}.{name} has no default for EngineArgs to take")
    return dataclasses.field(default=default, metadata=dict(
        config=config, name=name, help=help, flag=flag, metavar=metavar, choices=choices, group=group,
        aliases=aliases))


def json_object(text: str) -> dict:
    """argparse type of --hf-overrides: a JSON object, else one line saying what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} (a {type(value).__name__})")
    return value


@dataclass
class EngineArgs:
    """The options of one engine (the keywords of `LLM`, the engine flags of every command)."""

    model: str | None = _option(
        EngineConfig, "model", "a directory, a .gguf file, a short name (smollm2-135m, gemma3-270m) or a Hugging "
        "Face name org/name[/file.gguf] (default: the embedded smollm2-135m)")
    dtype: str = _option(
        EngineConfig, "dtype", "auto (CPU: fp32 or bf16, whichever is faster here; GPU: bf16), float32, bfloat16, "
        "float16")
    quantization: str = _option(
        EngineConfig, "quantization", "auto: a GGUF's quantized weights stay quantized on a CPU with the kernels; "
        "none: dequantize them (the reference path); gguf: keep them quantized; int8/int4: quantize linear layers "
        "at load (groups of 32)", choices=QUANTIZATIONS)
    activation_levels: str = _option(
        EngineConfig, "activation_levels", "int8 levels of the activations of quantized matmuls on the CPU (one: "
        "~8 bits, llama.cpp's Q8; two: ~15 bits, twice the integer work); auto: two for q/k/v and 8-bit "
        "weights, one for o, gate/up, down and the LM head", choices=ACTIVATION_LEVELS)
    revision: str | None = _option(
        EngineConfig, "revision", "branch, tag or commit of a Hugging Face model name (default: its default branch)")
    mmproj: str | None = _option(
        EngineConfig, "mmproj", "llama.cpp's vision file (an mmproj .gguf: Gemma 3, Qwen2-VL / Qwen2.5-VL or "
        "LLaVA-1.5 projector) for a .gguf language model, which then reads pictures (as llama-server's --mmproj)",
        metavar="FILE")
    device: str | None = _option(EngineConfig, "device", "cpu, cuda, cuda:N (default: cuda if available)")
    tensor_parallel_size: int = _option(
        EngineConfig, "tensor_parallel_size", "split every layer over N ranks, one process and one device each "
        "(cuda:N..: consecutive GPUs from --device's index); 1: one process, no torch.distributed", metavar="N")
    expert_parallel_size: int = _option(
        EngineConfig, "expert_parallel_size", "split the routed MoE experts into N slices over the tensor-parallel "
        "ranks, each rank computing 1/N of them (must divide --tensor-parallel-size; DeepSeek-V4)", metavar="N")
    attention_backend: str = _option(
        EngineConfig, "attention_backend", "attention kernels: auto (triton on CUDA, torch on the CPU), torch (the "
        "reference), triton (Triton store and decode kernels; interpreted, slowly, on the CPU)",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = _option(
        EngineConfig, "enforce_eager", "run every step eagerly: no CUDA graphs for decode steps (by default they "
        "are captured at start-up on CUDA with the triton backend)")
    max_model_len: int | None = _option(
        EngineConfig, "max_model_len", "prompt + output tokens per request (default: the model's context where "
        "the KV cache can hold one request that long, else the longest it can hold)", aliases=("--ctx-size",))
    allow_long_max_model_len: bool = _option(
        EngineConfig, "allow_long_max_model_len", "accept a --max-model-len beyond the model's context (also "
        "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1); positions past it give garbage")
    kv_cache_memory: str | int = _option(
        CacheConfig, "kv_cache_memory", "KV cache size, e.g. 512MiB, 2GiB; auto: what --max-num-seqs requests at "
        "--max-model-len need, at most --gpu-memory-utilization of the memory free after the weights")
    gpu_memory_utilization: float = _option(
        CacheConfig, "gpu_memory_utilization", "fraction of the free memory (GPU, or the CPU's MemAvailable) "
        "--kv-cache-memory auto may take")
    num_blocks: int | None = _option(CacheConfig, "num_blocks", "paged blocks (overrides --kv-cache-memory)")
    block_size: int = _option(CacheConfig, "block_size", "tokens per paged block")
    kv_cache_dtype: str = _option(
        CacheConfig, "kv_cache_dtype", "cache row format: auto (the compute dtype), bfloat16, fp8 (MXFP8: "
        "e4m3 + UE8M0 per 32), or int8 (CPU: int8 + an fp32 scale per 32)", choices=KV_CACHE_DTYPES)
    max_num_seqs: int = _option(SchedulerConfig, "max_num_seqs", "requests running at once")
    max_num_batched_tokens: int = _option(SchedulerConfig, "max_num_batched_tokens", "token budget per step")
    scheduling_policy: str = _option(
        SchedulerConfig, "scheduling_policy", "fcfs: waiting requests in arrival order (a request's priority must "
        "be 0); priority: by (priority, arrival), a lower value first, and a waiting request may preempt a running "
        "one of worse priority. Both share admissions fairly among clients (API key, `user`, client_id)",
        choices=SCHEDULING_POLICIES)
    seed: int = _option(EngineConfig, "seed", "engine seed for unseeded sampling")
    num_threads: int | None = _option(
        EngineConfig, "num_threads", "CPU threads for the model's kernels, per rank (default: torch's choice, the "
        "physical cores; with --tensor-parallel-size N each rank takes 1/N of them)", flag="--threads", metavar="N")
    hf_overrides: dict | None = _option(
        EngineConfig, "hf_overrides", 'JSON object of model config fields to override, e.g. \'{"sliding_window": '
        "128}'")
    speculative_method: str | None = _option(
        SpeculativeConfig, "method", "draft tokens and verify them in one pass: ngram (prompt lookup, any model), "
        "mtp (DeepSeek-V4's next-n module) or draft_model (--speculative-model); default: none",
        choices=SPECULATIVE_METHODS)
    speculative_model: str | None = _option(
        SpeculativeConfig, "model", "a smaller draft model (a .gguf file or an HF directory, with the target's "
        "tokenizer) whose greedy tokens are verified by the model; implies --speculative-method draft_model",
        metavar="PATH")
    num_speculative_tokens: int | None = _option(
        SpeculativeConfig, "num_speculative_tokens", "k: draft tokens a step may verify; rings keep S >= W + k + 1 "
        "(default: DEEPINFER_USE_NEXTN_DECODE, 5)")
    speculative_draft_length: str = _option(
        SpeculativeConfig, "draft_length", "adaptive: per request, as many drafts (up to k) as its running "
        "acceptance says pay for their draft passes and verification rows; fixed: k every step",
        choices=DRAFT_LENGTHS)
    speculative_row_cost: float = _option(
        SpeculativeConfig, "row_cost", "adaptive draft length: the cost of one more verification row as a share "
        "of a decode step (decode reads the weights once for every row)")
    chat_template: str | None = _option(
        EngineConfig, "chat_template", "a chat template replacing the model's own: a path to a Jinja file, or the "
        "template text itself (as vLLM's flag); chat requests, `deepinfer chat` and `generate` render with it",
        metavar="FILE|TEMPLATE")
    load_format: str = _option(
        EngineConfig, "load_format", "auto: the checkpoint's weights; dummy: config.json only, seeded random "
        "weights (benchmarks and memory figures without weight files)", choices=LOAD_FORMATS)
    pooling: str = _option(
        EngineConfig, "pooling", "embeddings (LLM.embed, /v1/embeddings): how a prompt's final hidden rows become one "
        "vector; auto: what the checkpoint declares (sentence-transformers modules.json), else last token, "
        "L2-normalised; last, mean, cls (the first token) override it", choices=POOLING_CHOICES)
    enable_prefix_caching: bool = _option(
        CacheConfig, "enable_prefix_caching", "reuse the KV blocks of a prompt prefix computed before (requests "
        "share them only when their cache_salt is equal)", group=PREFIX)
    kv_cache_dir: str | None = _option(
        CacheConfig, "kv_cache_dir", "save computed KV blocks in this directory; a later start-up of the same model "
        "reads them (default: none, the cache lives in memory only; `bench --workload prefix`: the restart run's "
        "directory, default a temporary one)", metavar="PATH", group=PREFIX)
    kv_cache_dir_size: str | int = _option(
        CacheConfig, "kv_cache_dir_size", "most bytes --kv-cache-dir may hold, e.g. 512MiB, 4GiB; the least "
        "recently used files go first", metavar="SIZE", group=PREFIX)
    prefix_snapshot_interval: int = _option(
        CacheConfig, "prefix_snapshot_interval", "ring models (sliding window, DeepSeek-V4): tokens between "
        "snapshots of a long prefill", metavar="N", group=PREFIX)
    num_prefix_snapshots: int | None = _option(
        CacheConfig, "num_prefix_snapshots", "ring models: snapshot slots kept for prefix hits (default: min(16, "
        "--max-num-seqs))", metavar="N", group=PREFIX)

    enable_lora: bool = _option(
        LoRAConfig, "enable_lora", "serve LoRA adapters (PEFT directories): requests name one "
        "(LLM.generate(..., lora_request=LoRARequest(name, id, path)), the server's `model` field)", group=LORA)
    max_loras: int = _option(
        LoRAConfig, "max_loras", "adapters resident at once (device slots; a request whose adapter cannot get one "
        "waits)", metavar="N", group=LORA)
    max_lora_rank: int = _option(
        LoRAConfig, "max_lora_rank", "the largest adapter rank accepted (every slot holds this rank)", metavar="R",
        group=LORA)

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig (with its scheduler, cache and speculative configs) these options describe;
        ValueError naming the field and the value when one is bad."""
        parts: dict[type, dict] = {SchedulerConfig: {}, CacheConfig: {}, SpeculativeConfig: {}, LoRAConfig: {},
                                   EngineConfig: {}}
        for f in dataclasses.fields(self):  # shallow: a ModelSource or LoRA module stays an object
            parts[f.metadata["config"]][f.metadata["name"]] = vars(self)[f.name]
        cache = CacheConfig(**parts[CacheConfig])
        scheduler = SchedulerConfig(**parts[SchedulerConfig])
        speculative = SpeculativeConfig(**parts[SpeculativeConfig])
        return EngineConfig(**parts[EngineConfig], scheduler=scheduler, cache=cache, speculative=speculative,
                            lora=LoRAConfig(**parts[LoRAConfig]))

    def create_cache_config(self) -> CacheConfig:
        """The CacheConfig alone (ValueError naming the field and the value when one is bad)."""
        return self.create_engine_config().cache

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field, in argument groups ("engine", "prefix caching"), with its default."""
        groups: dict[str, argparse._ArgumentGroup] = {}
        hints = typing.get_type_hints(EngineArgs)
        for f in dataclasses.fields(EngineArgs):
            name = f.metadata["group"]
            if name not in groups:
                groups[name] = parser.add_argument_group(name)
            groups[name].add_argument(cli_flag(f), *f.metadata["aliases"], dest=cli_dest(f), default=f.default,
                                      help=f.metadata["help"], **_cli_kind(hints[f.name], f))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The options a namespace parsed by a parser with `add_cli_args` holds."""
        return cls(**{f.name: vars(args)[cli_dest(f)] for f in dataclasses.fields(cls)})


def cli_flag(f: dataclasses.Field) -> str:
    """The flag of an EngineArgs field: its own (`--threads`), else `--` + the name in kebab case."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def cli_dest(f: dataclasses.Field) -> str:
    """Where argparse puts the field's flag (`threads` for num_threads)."""
    return cli_flag(f).removeprefix("--").replace("-", "_")


def _cli_kind(hint, f: dataclasses.Field) -> dict:
    """argparse's action / type / choices / metavar for a field of type `hint`: bools are switches
    (--x, or --x / --no-x when on by default), ints and floats are converted, a dict is JSON; the rest
    (names, sizes such as 2GiB) stay strings for the configs to check."""
    kinds = set(typing.get_args(hint)) - {type(None)} or {hint}
    if kinds == {bool}:
        return {"action": argparse.BooleanOptionalAction if f.default else "store_true"}
    kind = {"metavar": f.metadata["metavar"]} if f.metadata["metavar"] else {}
    if f.metadata["choices"]:
        kind["choices"] = list(f.metadata["choices"])
    converter = {int: int, float: float, dict: json_object}.get(next(iter(kinds))) if len(kinds) == 1 else None
    return kind | ({"type": converter} if converter else {})
