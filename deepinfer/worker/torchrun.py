"""Tensor parallelism over the processes `torchrun` started, possibly on several machines:

    torchrun --nnodes 2 --nproc-per-node 8 ... -m deepinfer.entrypoints.cli serve --model M

    rank 0 (TorchrunRunner: the driver)                 rank r > 0 (run_follower)
    ───────────────────────────────────                 ────────────────────────────────────
    join the group (env://, cuda:LOCAL_RANK or cpu) <─> join the group
    new gloo group for plans (BroadcastChannel) <─────> the same new_group call
    broadcast its EngineConfig ───────────────────────> take it (its own device)
    ModelRunner: load, size the cache <───────────────> ModelRunner: load its slices (MIN all_reduce)
    execute(plan): broadcast the plan ────────────────> follow(plan)
    close() (or exit): broadcast None ────────────────> leave the group; the command returns 0

Rank 0 runs the command as usual (scheduler, sampling, output); the other ranks run no command and
print nothing of its output. `--tensor-parallel-size` must equal WORLD_SIZE; left at 1 it becomes
WORLD_SIZE. The plan group waits for the next plan for a year (an idle engine never times out the
followers); the collectives inside a step run on the tensor-parallel group, whose timeout is
`COLLECTIVE_TIMEOUT_S`.

Failures: there is no watchdog here: torchrun watches its processes and tears the whole job down
when one dies. Until it does, rank 0 does not hang forever: a step collective that waits on a dead
follower raises (gloo as soon as the connection drops, else after COLLECTIVE_TIMEOUT_S; NCCL's
watchdog aborts the process after it) and the step is a FatalStepError. One engine per job: the
followers leave when rank 0's engine closes.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from deepinfer.config import EngineConfig
from deepinfer.distributed.parallel_state import destroy_parallel
from deepinfer.worker.model_runner import ModelRunner, resolve_device
from deepinfer.worker.multiproc import join_group, load_source
from deepinfer.worker.plan_channel import BroadcastChannel, DriverRunner, follow_plans

logger = logging.getLogger("deepinfer.worker")

_INIT_METHOD = "env://"  # MASTER_ADDR, MASTER_PORT from torchrun


@dataclass(frozen=True)
class TorchrunJob:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int

    def tensor_parallel_size(self, requested: int) -> int:
        """WORLD_SIZE when `requested` is the default (1) or equal to it; else ValueError naming both."""
        if requested in (1, self.world_size):
            return self.world_size
        raise ValueError(f"--tensor-parallel-size {requested} (tensor_parallel_size) must equal torchrun's "
                         f"WORLD_SIZE={self.world_size} (one rank per process); pass {self.world_size} "
                         f"or leave it unset")

    def device(self, name: str | None) -> str:
        """This rank's device: cuda:LOCAL_RANK on CUDA, else the CPU. ValueError when this machine has
        too few GPUs."""
        device = resolve_device(name)
        if device.type != "cuda":
            return str(device)
        if self.local_rank >= torch.cuda.device_count():
            raise ValueError(f"torchrun LOCAL_RANK={self.local_rank} needs cuda:{self.local_rank}; "
                             f"this process sees {torch.cuda.device_count()} GPUs")
        return f"cuda:{self.local_rank}"


def torchrun_job(environ: Mapping[str, str] = os.environ) -> TorchrunJob | None:
    """The job torchrun started this process in (TORCHELASTIC_RUN_ID or RANK set), else None.
    ValueError naming a missing or malformed variable."""
    if "TORCHELASTIC_RUN_ID" not in environ and "RANK" not in environ:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        try:
            values[name] = int(environ[name])
        except (KeyError, ValueError):
            raise ValueError(f"torchrun environment: {name}={environ.get(name)!r} is not an integer") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"]:
        raise ValueError(f"torchrun environment: RANK={values['RANK']} outside WORLD_SIZE={values['WORLD_SIZE']}")
    return TorchrunJob(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])


def run_follower(device_name: str | None, job: TorchrunJob) -> None:
    """Rank > 0: join the group, take rank 0's config, build this rank's ModelRunner and run every
    plan rank 0 broadcasts until it closes."""
    device = job.device(device_name)
    join_group(job.rank, job.world_size, _INIT_METHOD, device)
    runner = None
    try:
        channel = BroadcastChannel.new()
        config: EngineConfig = channel.recv()
        config.device = device
        runner = ModelRunner(load_source(config), config)
        follow_plans(runner, channel)
    finally:
        if runner is not None:
            runner.close()
        destroy_parallel()


class TorchrunRunner(DriverRunner):
    """The engine's `StepRunner` on rank 0 of a torchrun job: rank 0's ModelRunner (`driver`, it
    samples) plus the job's other ranks, fed plans by broadcast (`BroadcastChannel`)."""

    def __init__(self, source, config: EngineConfig, job: TorchrunJob):
        self._failure: list[str] = []  # the failure once there is one; shared with the finalizer
        config.device = job.device(config.device)
        join_group(0, job.world_size, _INIT_METHOD, config.device)
        try:
            self.channel = BroadcastChannel.new()
            self.channel.send(config)  # the followers build theirs from it
            self.driver = ModelRunner(source, config)
        except BaseException:
            destroy_parallel()
            raise
        # holds what it closes, never this runner: one dropped without close() is still collected
        self._finalizer = weakref.finalize(self, _leave, self.channel, self.driver, self._failure)
        logger.info("tensor parallel (torchrun): rank 0 of %d (pid %d), device %s",
                    job.world_size, os.getpid(), config.device)

    @property
    def failure(self) -> str | None:
        """Why the ranks can no longer step together (None while they can)."""
        return self._failure[0] if self._failure else None

    @failure.setter
    def failure(self, text: str | None) -> None:
        self._failure[:] = [] if text is None else [text]

    def close(self) -> None:
        """Tell the followers to leave (not after a failure: they may wait elsewhere and torchrun
        tears them down), close the driver, leave the group (idempotent). Also done when the runner
        is garbage collected, and at exit."""
        self._finalizer()


def _leave(channel: BroadcastChannel, driver: ModelRunner, failure: list[str]) -> None:
    """TorchrunRunner's finalizer (close(), collection or exit; runs once)."""
    try:
        if not failure:
            try:
                channel.send(None)
            except Exception as exc:  # a follower is gone: torchrun ends the job anyway
                logger.warning("tensor parallel (torchrun): could not stop the followers: %s", exc)
        driver.close()
    finally:
        destroy_parallel()
