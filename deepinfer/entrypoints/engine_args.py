"""The engine and sampling flags every command shares, and the LLM and sampling parameters they build.

Light to import (no torch): the CLI registers these argument groups on each subcommand, and the
commands (generate, chat, info, bench, serve) build their engine with `make_llm`. The engine flags
are EngineArgs' fields (`deepinfer/engine_args.py`: names, defaults, help and choices live there).
"""

from __future__ import annotations

import argparse
import dataclasses

from deepinfer.config import CacheConfig
from deepinfer.engine_args import EngineArgs
from deepinfer.sampling_params import FALLBACK_SAMPLING, SamplingParams

# the sampling flags that default to the model's choice (LLM.get_default_sampling_params), with what a
# model whose checkpoint names none of them gets, for --help
MODEL_DEFAULT_FLAGS = {"top_k": "off", "min_p": "off"} | {k: str(v) for k, v in FALLBACK_SAMPLING.items()}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine and prefix-caching flags: one per EngineArgs field (`deepinfer/engine_args.py`)."""
    EngineArgs.add_cli_args(p)


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


def cache_config(args) -> CacheConfig:
    """The CacheConfig the flags describe (ValueError naming the field and value when one is bad)."""
    return EngineArgs.from_cli_args(args).create_cache_config()


def engine_kwargs(args) -> dict:
    """The engine flags as `LLM(args.model, **engine_kwargs(args))` keywords (every EngineArgs field but model)."""
    engine_args = EngineArgs.from_cli_args(args)  # shallow: dataclasses.asdict would turn nested objects into dicts
    return {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args) if f.name != "model"}


def use_model_defaults(parser: argparse.ArgumentParser, max_tokens: int, max_tokens_help: str) -> None:
    """Make a parser's sampling flags default to None ("the model's": the same defaults as the server
    and `LLM.generate`) and say so in --help; --max-tokens defaults to `max_tokens`."""
    for action in parser._actions:
        if action.dest in MODEL_DEFAULT_FLAGS:
            action.default = None
            action.help = (f"{action.help}; " if action.help else "") + \
                f"default: the model's generation config, else {MODEL_DEFAULT_FLAGS[action.dest]}"
        elif action.dest == "max_tokens":
            action.default = max_tokens
            action.help = f"{max_tokens_help} (default: {max_tokens})"


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
    """The LLM the flags describe; bad engine flags are refused before torch and the model load."""
    EngineArgs.from_cli_args(args).create_engine_config()
    from deepinfer.llm import LLM

    return LLM(args.model, **engine_kwargs(args))
