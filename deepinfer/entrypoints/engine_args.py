"""The engine and sampling flags every command shares, and the LLM and sampling parameters they build.

Light to import (no torch): the CLI registers these argument groups on each subcommand, and the
commands (generate, chat, info, bench, serve) build their engine with `make_llm`.
"""

from __future__ import annotations

import argparse
import json

from deepinfer.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SPECULATIVE_METHODS,
    CacheConfig,
)
from deepinfer.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="a directory, a .gguf file, a short name (smollm2-135m, gemma3-270m) or a Hugging "
                        "Face name org/name[/file.gguf] (default: the embedded smollm2-135m)")
    g.add_argument("--dtype", default="auto",
                   help="auto (CPU: fp32 or bf16, whichever is faster here; GPU: bf16), float32, bfloat16, float16")
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="auto: a GGUF's quantized weights stay quantized on a CPU with the kernels; none: "
                        "dequantize them (the reference path); gguf: keep them quantized; int8/int4: "
                        "quantize linear layers at load (groups of 32)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face model name (default: its default branch)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda if available)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split every layer over N ranks, one process and one device each (cuda:N..: "
                        "consecutive GPUs from --device's index); 1: one process, no torch.distributed")
    g.add_argument("--expert-parallel-size", type=int, default=1, metavar="N",
                   help="split the routed MoE experts into N slices over the tensor-parallel ranks, each "
                        "rank computing 1/N of them (must divide --tensor-parallel-size; DeepSeek-V4)")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="attention kernels: auto (triton on CUDA, torch on the CPU), torch (the reference), "
                        "triton (Triton store and decode kernels; interpreted, slowly, on the CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs for decode steps (by default they are "
                        "captured at start-up on CUDA with the triton backend)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: min(the model's context, 4096))")
    g.add_argument("--allow-long-max-model-len", action="store_true",
                   help="accept a --max-model-len beyond the model's context (also "
                        "DEEPINFER_ALLOW_LONG_MAX_MODEL_LEN=1); positions past it give garbage")
    g.add_argument("--kv-cache-memory", default="auto",
                   help="KV cache size, e.g. 512MiB, 2GiB; auto: what --max-num-seqs requests at --max-model-len "
                        "need, at most --gpu-memory-utilization of the memory free after the weights")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the free memory (GPU, or the CPU's MemAvailable) --kv-cache-memory auto "
                        "may take")
    g.add_argument("--num-blocks", type=int, default=None, help="paged blocks (overrides --kv-cache-memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per paged block")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="cache row format: auto (the compute dtype), bfloat16, or fp8 (MXFP8: e4m3 + UE8M0 per 32)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget per step")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    g.add_argument("--hf-overrides", type=json_object, default=None,
                   help='JSON object of model config fields to override, e.g. \'{"sliding_window": 128}\'')
    g.add_argument("--speculative-method", default=None, choices=list(SPECULATIVE_METHODS),
                   help="draft tokens and verify them in one pass: ngram (prompt lookup, any model) "
                        "or mtp (DeepSeek-V4's next-n module); default: none")
    g.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="k: draft tokens a step may verify; rings keep S >= W + k + 1 "
                        "(default: DEEPINFER_USE_NEXTN_DECODE, 5)")
    g.add_argument("--load-format", default="auto", choices=list(LOAD_FORMATS),
                   help="auto: the checkpoint's weights; dummy: config.json only, seeded random weights "
                        "(benchmarks and memory figures without weight files)")
    add_prefix_cache_args(p)


def json_object(text: str) -> dict:
    """argparse type of --hf-overrides: a JSON object, else one line saying what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text!r} (a {type(value).__name__})")
    return value


def add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix caching")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix computed before (requests share them only "
                        "when their cache_salt is equal)")
    g.add_argument("--kv-cache-dir", default=None, metavar="PATH",
                   help="save computed KV blocks in this directory; a later start-up of the same model "
                        "reads them (default: none, the cache lives in memory only; `bench --workload "
                        "prefix`: the restart run's directory, default a temporary one)")
    g.add_argument("--kv-cache-dir-size", default="4GiB", metavar="SIZE",
                   help="most bytes --kv-cache-dir may hold, e.g. 512MiB, 4GiB; the least recently used "
                        "files go first")
    g.add_argument("--prefix-snapshot-interval", type=int, default=512, metavar="N",
                   help="ring models (sliding window, DeepSeek-V4): tokens between snapshots of a long prefill")
    g.add_argument("--num-prefix-snapshots", type=int, default=None, metavar="N",
                   help="ring models: snapshot slots kept for prefix hits (default: min(16, --max-num-seqs))")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def prefix_cache_kwargs(args) -> dict:
    """The prefix-caching flags as `LLM` / `CacheConfig` keyword arguments."""
    return dict(enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                kv_cache_dir=getattr(args, "kv_cache_dir", None),
                kv_cache_dir_size=getattr(args, "kv_cache_dir_size", "4GiB"),
                prefix_snapshot_interval=getattr(args, "prefix_snapshot_interval", 512),
                num_prefix_snapshots=getattr(args, "num_prefix_snapshots", None))


def cache_config(args) -> CacheConfig:
    """The CacheConfig the flags describe (ValueError naming the field and value when one is bad)."""
    return CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
                       kv_cache_dtype=args.kv_cache_dtype,
                       gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9), **prefix_cache_kwargs(args))


def engine_kwargs(args) -> dict:
    return dict(dtype=args.dtype, quantization=getattr(args, "quantization", "auto"), device=args.device,
                attention_backend=getattr(args, "attention_backend", "auto"),
                enforce_eager=getattr(args, "enforce_eager", False),
                max_model_len=args.max_model_len, revision=getattr(args, "revision", None),
                allow_long_max_model_len=getattr(args, "allow_long_max_model_len", False),
                gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9),
                kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks, block_size=args.block_size,
                kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                speculative_method=getattr(args, "speculative_method", None),
                num_speculative_tokens=args.num_speculative_tokens, hf_overrides=args.hf_overrides,
                load_format=getattr(args, "load_format", "auto"),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                expert_parallel_size=getattr(args, "expert_parallel_size", 1), **prefix_cache_kwargs(args))


def sampling_params(args, defaults: SamplingParams | None = None) -> SamplingParams:
    """The sampling flags as SamplingParams; a flag left None takes its value from `defaults` (e.g.
    the model's, `LLM.get_default_sampling_params()`), else SamplingParams' own default."""
    given = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                 top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                 presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                 seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    base = {name: getattr(defaults, name) for name in given} if defaults is not None else {}
    return SamplingParams(**{**base, **{name: value for name, value in given.items() if value is not None}})


def make_llm(args):
    """The LLM the flags describe; bad cache flags are refused before the model loads."""
    from deepinfer.llm import LLM

    cache_config(args)
    return LLM(args.model, **engine_kwargs(args))
