"""EngineArgs is the one list of engine options: the CLI's engine flags and `LLM`'s keywords are generated
from its fields, its defaults are the config dataclasses' (each written once in the package), and an
unknown keyword is a TypeError naming the closest option before anything loads."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import deepinfer.llm
from deepinfer import LLM
from deepinfer.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig, SpeculativeConfig
from deepinfer.engine_args import EngineArgs, cli_dest, cli_flag
from deepinfer.entrypoints.engine_args import add_engine_args, engine_kwargs
from deepinfer.llm_options import CHECKED, NO_EFFECT, accepted_keywords

PACKAGE = Path(deepinfer.llm.__file__).parent
FIELDS = dataclasses.fields(EngineArgs)
# config fields that are not options: filled in by the engine (env), composite, or fixed (the n-gram
# proposer's lookup lengths)
NOT_OPTIONS = {(SpeculativeConfig, "prompt_lookup_max"), (SpeculativeConfig, "prompt_lookup_min"),
               (EngineConfig, "scheduler"), (EngineConfig, "cache"), (EngineConfig, "speculative"),
               (EngineConfig, "lora"), (EngineConfig, "env")}
# a value we can give each vLLM-only keyword without changing anything
VLLM_VALUES = {"trust_remote_code": True, "swap_space": 4, "disable_log_stats": True, "pipeline_parallel_size": 1,
               "tokenizer": None, "tokenizer_mode": "auto"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_field_is_a_flag_with_its_default():
    actions = {s: a for a in _parser()._actions for s in a.option_strings}
    for f in FIELDS:
        action = actions[cli_flag(f)]
        assert action.dest == cli_dest(f) and action.default == f.default, f.name
        assert action.help == f.metadata["help"] and action.choices == (
            list(f.metadata["choices"]) if f.metadata["choices"] else None), f.name
    engine_flags = {s for s in actions if s not in ("-h", "--help")}
    aliases = {a for f in FIELDS for a in f.metadata["aliases"]}
    assert aliases == {"--ctx-size"} and actions["--ctx-size"] is actions["--max-model-len"]
    assert engine_flags == {cli_flag(f) for f in FIELDS} | {"--no-enable-prefix-caching"} | aliases
    assert EngineArgs.from_cli_args(_parser().parse_args([])) == EngineArgs()
    assert actions["--threads"].dest == "threads" and "--num-threads" not in actions


def test_the_defaults_are_the_configs_and_every_config_option_is_a_field():
    for f in FIELDS:
        config, name = f.metadata["config"], f.metadata["name"]
        assert f.default == config.__dataclass_fields__[name].default, f.name
    covered = {(f.metadata["config"], f.metadata["name"]) for f in FIELDS}
    every = {(c, f.name) for c in (EngineConfig, SchedulerConfig, CacheConfig, SpeculativeConfig, LoRAConfig)
             for f in dataclasses.fields(c)}
    assert every - NOT_OPTIONS == covered
    assert EngineArgs().create_engine_config() == EngineConfig()


def test_flags_reach_the_engine_config():
    args = _parser().parse_args(["--threads", "3", "--no-enable-prefix-caching", "--hf-overrides", '{"a": 1}',
                                 "--gpu-memory-utilization", "0.5", "--speculative-method", "ngram",
                                 "--num-speculative-tokens", "3", "--max-num-seqs", "7", "--model", "m"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert (config.num_threads, config.hf_overrides, config.model) == (3, {"a": 1}, "m")
    assert (config.cache.enable_prefix_caching, config.cache.gpu_memory_utilization) == (False, 0.5)
    assert (config.speculative.method, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert config.scheduler.max_num_seqs == 7
    assert set(engine_kwargs(args)) == {f.name for f in FIELDS} - {"model"}
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in \\(0, 1\\], got 1.5"):
        EngineArgs(gpu_memory_utilization=1.5).create_engine_config()


@pytest.fixture
def built(monkeypatch) -> list[EngineConfig]:
    """The configs `LLM(...)` builds its engines from; no model is loaded."""
    configs = []
    monkeypatch.setattr(deepinfer.llm, "build_engine",
                        lambda config: configs.append(config) or types.SimpleNamespace(close=lambda: None))
    return configs


def test_llm_takes_exactly_the_fields_and_vllms_names(built):
    assert set(accepted_keywords()) == {f.name for f in FIELDS} | NO_EFFECT.keys() | CHECKED.keys()
    assert set(VLLM_VALUES) == NO_EFFECT.keys() | CHECKED.keys()
    for f in FIELDS:
        LLM(**{f.name: f.default})
    for name, value in VLLM_VALUES.items():
        LLM(**{name: value})
    assert all(config == EngineConfig() for config in built)
    LLM("m", gpu_memory_utilization=0.5, max_num_seqs=3, num_threads=2, speculative_method="ngram",
        kv_cache_dir_size="1GiB", trust_remote_code=True)
    config = built[-1]
    assert (config.model, config.cache.gpu_memory_utilization, config.scheduler.max_num_seqs) == ("m", 0.5, 3)
    assert (config.num_threads, config.speculative.method, config.cache.kv_cache_dir_size) == (2, "ngram", 2**30)
    signature = inspect.signature(LLM)
    assert list(signature.parameters)[:-1] == [f.name for f in FIELDS]
    assert all(signature.parameters[f.name].default == f.default for f in FIELDS)


@pytest.mark.parametrize("typo, meant", [
    ("max_num_seq", "'max_num_seqs'"), ("gpu_mem_util", "'gpu_memory_utilization'"),
    ("trust_remote_cod", "'trust_remote_code'"), ("threads", "'num_threads'")])
def test_an_unknown_keyword_names_the_closest_before_loading(typo, meant, monkeypatch):
    def no_load(config):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(deepinfer.llm, "build_engine", no_load)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}' \\(did you mean {meant}") as exc:
        LLM("/no/such/model", **{typo: 4})
    assert "accepted keywords: activation_levels, allow_long_max_model_len," in str(exc.value)  # sorted


def test_a_far_off_keyword_gets_no_suggestion():
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'; accepted keywords"):
        LLM(zzz=1)


# -- each default is written once ---------------------------------------------------------------------------

# defaults that are everywhere for other reasons (None, switches, "auto", 0, 1) are not searched for
# by the config field's name (an option's default is written there, e.g. SpeculativeConfig.row_cost)
DISTINCT = {f.metadata["name"]: f.default for f in FIELDS
            if f.default is not None and not isinstance(f.default, bool) and f.default not in ("auto", 0, 1)}


def _default_literals(tree: ast.AST):
    """(line, name, value) of each literal given as `name`'s default or value: a dataclass field default,
    a parameter default, a keyword argument, or getattr(x, "name", value)'s fallback."""
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.lineno, node.target.id, node.value
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            with_defaults = positional[len(positional) - len(a.defaults):]
            pairs = [*zip(with_defaults, a.defaults, strict=True), *zip(a.kwonlyargs, a.kw_defaults, strict=True)]
            yield from ((node.lineno, arg.arg, default) for arg, default in pairs)
        elif isinstance(node, ast.Call):
            yield from ((node.lineno, kw.arg, kw.value) for kw in node.keywords)
            if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) == 3 and isinstance(
                    node.args[1], ast.Constant):
                yield node.lineno, node.args[1].value, node.args[2]


def test_each_default_literal_is_written_once_in_the_package():
    """E.g. gpu_memory_utilization's 0.9: in CacheConfig, and nowhere else (EngineArgs takes it from there)."""
    found = {name: [] for name in DISTINCT}
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, name, value in _default_literals(ast.parse(path.read_text())):
            if name in DISTINCT and isinstance(value, ast.Constant) and value.value == DISTINCT[name]:
                found[name].append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert {"gpu_memory_utilization", "max_num_seqs", "block_size", "kv_cache_dir_size"} <= DISTINCT.keys()
    assert {name: len(places) for name, places in found.items()} == dict.fromkeys(DISTINCT, 1), found
    assert found["gpu_memory_utilization"][0].startswith("deepinfer/config.py:")


@pytest.mark.subprocess
def test_engine_args_and_the_engine_flags_import_without_torch():
    code = textwrap.dedent("""
        import argparse, sys
        sys.modules["torch"] = None
        from deepinfer.engine_args import EngineArgs
        from deepinfer.entrypoints.engine_args import add_engine_args
        from deepinfer.llm_options import llm_engine_args
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        args = EngineArgs.from_cli_args(parser.parse_args(["--max-num-seqs", "5"]))
        assert args.create_engine_config().scheduler.max_num_seqs == 5
        assert llm_engine_args(None, {"block_size": 8}).block_size == 8
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
