"""Compose the system: `build_engine(config)` loads the model source, builds the runner (model,
caches, sampler: one rank, spawned ranks or torchrun's) and hands both to the engine. The only
place that knows every layer; `LLM` (llm.py) and the entry points call it.

max_model_len is resolved by the runner before any model is built (`worker/context_length.py`):
the engine takes the runner's config, which holds it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from deepinfer.config import EngineConfig
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.worker.device import set_cpu_threads
from deepinfer.worker.model_runner import ModelRunner, resolve_device
from deepinfer.worker.multiproc import MultiprocRunner, load_source
from deepinfer.worker.summary import startup_summary
from deepinfer.worker.torchrun import TorchrunRunner, run_follower, torchrun_job

logger = logging.getLogger("deepinfer")


def build_engine(config: EngineConfig) -> LLMEngine:
    """Compose the system: load the model source, build the runner (model, caches, sampler) and
    hand both to the engine. The only place that knows every layer. Logs one start-up summary
    line (load time, weights, KV cache, concurrency, dtype, quantization, backend, device).

    Under torchrun (`worker/torchrun.py`) tensor_parallel_size must be WORLD_SIZE (1 means it);
    rank 0 builds the engine, and any other rank serves rank 0's steps here and exits (SystemExit(0))."""
    start = time.perf_counter()
    resolve_device(config.device)  # a bad --device fails before the model loads
    set_cpu_threads(config.num_threads)
    job = torchrun_job()
    if job is not None:
        config = dataclasses.replace(config, tensor_parallel_size=job.tensor_parallel_size(config.tensor_parallel_size))
        if job.rank > 0:
            run_follower(config.device, job)
            raise SystemExit(0)
    source = with_mmproj(load_source(config), config.mmproj)
    runner = _build_runner(source, config, job)
    config = runner.config  # max_model_len resolved before the model was built (worker/context_length.py)
    engine = LLMEngine(config, source, runner, adapters=_adapter_checker(config, runner))
    logger.info("%s", startup_summary(engine.runner, engine.max_model_len, time.perf_counter() - start, source))
    return engine


def with_mmproj(source, mmproj: str | None):
    """The source with llama.cpp's vision file attached (`--mmproj`), or as it is without one."""
    if mmproj is None:
        return source
    from deepinfer.model_executor.loader.mmproj_source import attach_mmproj

    return attach_mmproj(source, mmproj)


def _adapter_checker(config: EngineConfig, runner):
    """With LoRA on, what checks the adapters requests name against rank 0's model (None: LoRA off)."""
    if not config.lora.enable_lora:
        return None
    from deepinfer.model_executor.loader.lora import AdapterChecker

    return AdapterChecker(runner.lora_base)


def _build_runner(source, config: EngineConfig, job):
    """One rank (ModelRunner), torchrun's ranks (TorchrunRunner) or spawned ranks (MultiprocRunner)."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(source, config)
    if job is not None:
        return TorchrunRunner(source, config, job)
    return MultiprocRunner(source, config)
