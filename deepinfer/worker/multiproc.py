"""Tensor parallelism over processes on one machine: this process is rank 0 and spawns and drives
N - 1 follower processes (`worker/torchrun.py` is the other launch: processes torchrun started).

    parent: rank 0 (MultiprocRunner)                 worker r = 1 .. N-1 (spawned, daemon)
    ────────────────────────────────                 ─────────────────────────────────────
    spawn the workers ─────────────────────────────> "joining" ─> status pipe
    wait for every "joining"; join the group <─────> join the group (tcp://127.0.0.1:PORT)
    ModelRunner: load, size the cache  <───────────> ModelRunner: load its slices, size the cache
                 (MIN over ranks of blocks, slots)                (the same all_reduce)
    wait for every "ready" <──────────────────────── "ready"
    execute(plan): the plan ─> every plan pipe ────> follow(plan): cache copies + forward
                   execute(plan): forward + sample   (the layers' collectives pair up in the forward)
    close(): None ─> every plan pipe ──────────────> leave the group, exit 0

Plans travel over one pipe per worker (`PipeChannel` in `worker/plan_channel.py`, which also holds
the follower loop and rank 0's runner wrapper), pickled once, not over a collective: a follower waits for
its next plan for as long as the engine idles, and a collective would time out (the process
group's timeout bounds only the collectives inside a step). A worker whose parent dies reads EOF
from its pipe and exits; one still joining or loading (not reading its pipe) sees its parent
change (`exit_with_parent`) within a second and exits, so no orphan stays behind.

Failures: a worker that raises sends its traceback on its status pipe and exits 1. A watchdog
thread waits on the workers' sentinels; at the first death it records which rank died and why
(exit code or signal, or the exception text), terminates the other workers, and from then on
`execute` raises `FatalStepError` naming that rank. A step that fails on rank 0 is fatal too: the
ranks are out of step (some may wait in a collective), so the engine must not retry it.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing import connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.chat_template import apply_chat_template_override
from deepinfer.config import EngineConfig
from deepinfer.contracts.plan import FatalStepError, describe_fault
from deepinfer.distributed.parallel_state import backend_for, check_no_group, destroy_parallel, init_parallel
from deepinfer.model_executor.loader import load_model_source
from deepinfer.worker.device import set_cpu_threads
from deepinfer.worker.model_runner import ModelRunner, resolve_device
from deepinfer.worker.plan_channel import DriverRunner, PipeChannel, follow_plans

logger = logging.getLogger("deepinfer.worker")

COLLECTIVE_TIMEOUT_S = 300  # a collective inside a step (or at start-up) that waits longer raises
_JOIN_S = 10  # close(): how long a worker may take to leave before it is terminated
_DEATH_GRACE_S = 5  # a failed step waits this long for the watchdog to name a dying worker
_REAP_S = 2  # a dead worker's exit code is collected within this long


def load_source(config: EngineConfig):
    """The model source `config` names (weights, tokenizer with `chat_template` applied, hf_config with
    `hf_overrides` applied); every rank loads its own."""
    revision = {} if config.revision is None else {"revision": config.revision}
    source = load_model_source(config.model, load_format=config.load_format, **revision)
    for key, value in (config.hf_overrides or {}).items():
        setattr(source.hf_config, key, value)
    apply_chat_template_override(source.tokenizer, config.chat_template)
    return source


def rank_device(name: str | None, rank: int, world_size: int) -> str:
    """Rank `rank`'s device: the CPU for a CPU run; on CUDA, consecutive GPUs from `name`'s index
    (cuda:1 with 2 ranks -> cuda:1, cuda:2). ValueError when there are not enough GPUs."""
    device = resolve_device(name)
    if device.type != "cuda":
        return str(device)
    first = device.index or 0
    if first + world_size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={world_size} from device cuda:{first} needs "
                         f"{first + world_size} GPUs; this process sees {torch.cuda.device_count()}")
    return f"cuda:{first + rank}"


def join_group(rank: int, world_size: int, init_method: str, device: str) -> None:
    """Join the tensor-parallel group as `rank` (collectives time out after COLLECTIVE_TIMEOUT_S).
    RuntimeError when this process is still in a group (`check_no_group`)."""
    check_no_group()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    init_parallel(rank, world_size, init_method, device)  # records rank and size; the group is up


def free_init_method() -> str:
    """A tcp:// rendezvous on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ---- the worker process -------------------------------------------------------------------------


def worker_main(rank: int, world_size: int, init_method: str, config: EngineConfig, plans, status) -> None:
    """A follower rank: join, build its ModelRunner, then run every plan rank 0 sends until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops us
    exit_with_parent()
    runner = None
    try:
        status.send(("joining", None))
        config.device = rank_device(config.device, rank, world_size)
        if torch.device(config.device).type == "cpu":  # the ranks share the cores
            set_cpu_threads(config.num_threads, world_size)
        join_group(rank, world_size, init_method, config.device)
        runner = ModelRunner(load_source(config), config)
        status.send(("ready", None))
        follow_plans(runner, PipeChannel([plans]))
    except (EOFError, BrokenPipeError):  # the parent is gone: leave quietly
        sys.exit(1)
    except BaseException:
        _send_quietly(status, ("error", traceback.format_exc()))
        sys.exit(1)
    finally:
        if runner is not None:
            runner.close()
        destroy_parallel()


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process (exit code 1) as soon as its parent is gone, whatever it is blocked in
    (a rendezvous, loading): a daemon thread watches the parent pid."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="deepinfer-parent-watch", daemon=True).start()


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except OSError:
        pass


@dataclass
class Worker:
    """One follower process and the parent's ends of its pipes."""

    rank: int
    process: mp.Process
    plans: connection.Connection  # parent -> worker: pickled plans, then None
    status: connection.Connection  # worker -> parent: ("joining" | "ready" | "error", text)
    error: str | None = None  # the exception text the worker sent, if any

    def read_status(self) -> str | None:
        """The next status word (None when the pipe is closed); an error's text is kept."""
        try:
            word, text = self.status.recv()
        except (EOFError, OSError):
            return None
        if word == "error":
            self.error = text
        return word

    def why_dead(self) -> str:
        """'tensor-parallel rank 1 (pid 123) died: exit code -9 (SIGKILL)', with its exception."""
        _reap(self.process, _REAP_S)
        while self.error is None and self.status.poll() and self.read_status() is not None:
            pass
        code = self.process.exitcode
        how = f"exit code {code}" + (f" ({signal.Signals(-code).name})" if code is not None and code < 0 else "")
        text = f"tensor-parallel rank {self.rank} (pid {self.process.pid}) died: {how}"
        if self.error:
            text += f"; it raised:\n{self.error.rstrip()}"
        return text


def start_workers(config: EngineConfig, init_method: str, target=worker_main) -> list[Worker]:
    """Spawn ranks 1 .. N-1 (daemon processes) running `target` (`worker_main`'s signature)."""
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, config.tensor_parallel_size):
        plans_r, plans_w = ctx.Pipe(duplex=False)
        status_r, status_w = ctx.Pipe(duplex=False)
        process = ctx.Process(target=target, name=f"deepinfer-tp{rank}", daemon=True,
                              args=(rank, config.tensor_parallel_size, init_method, config, plans_r, status_w))
        process.start()
        plans_r.close()  # only the child holds these ends: its death closes them
        status_w.close()
        workers.append(Worker(rank, process, plans_w, status_r))
    return workers


def wait_for(workers: list[Worker], word: str) -> None:
    """Block until every worker has sent `word`; RuntimeError naming the first that dies first."""
    waiting = {w.status: w for w in workers}
    while waiting:
        for ready in connection.wait(list(waiting)):
            worker = waiting[ready]
            got = worker.read_status()
            if got is None or got == "error":
                raise RuntimeError(f"tensor-parallel start-up failed: {worker.why_dead()}")
            if got == word:
                del waiting[ready]


def stop_workers(workers: list[Worker], grace_s: float) -> None:
    """Ask each live worker to leave (None), wait up to `grace_s`, then terminate and kill; none
    stays alive."""
    for w in workers:
        try:
            w.plans.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    for w in workers:
        w.process.join(grace_s)
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(2)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.plans.close()
        w.status.close()


# ---- rank 0 ----------------------------------------------------------------------------------------


class MultiprocRunner(DriverRunner):
    """The engine's `StepRunner` for tensor_parallel_size N > 1 in one process tree: rank 0's
    ModelRunner (`driver`, in this process: it samples) plus N - 1 spawned follower processes, fed
    plans over pipes (`PipeChannel`). Every other attribute (groups, num_blocks, ...) is the driver's."""

    worker_target = staticmethod(worker_main)  # test switch: what the spawned workers run

    def __init__(self, source, config: EngineConfig):
        self.failure: str | None = None  # why the ranks can no longer step together
        check_no_group()  # before any worker starts
        world_size = config.tensor_parallel_size
        config.device = rank_device(config.device, 0, world_size)
        init_method = free_init_method()
        self._lock = threading.Lock()  # the watchdog and a failed step both read a dead worker's pipe
        self.workers = start_workers(config, init_method, self.worker_target)
        self.channel = PipeChannel(w.plans for w in self.workers)
        try:
            wait_for(self.workers, "joining")
            join_group(0, world_size, init_method, config.device)
            self.driver = ModelRunner(source, config)
            wait_for(self.workers, "ready")
        except BaseException as exc:
            fault = self._startup_fault(exc)
            self._abandon()
            raise fault from exc
        stop_r, stop_w = os.pipe()
        watchdog = threading.Thread(target=_watch, args=(weakref.ref(self), self.workers, stop_r),
                                    name="deepinfer-tp-watchdog", daemon=True)
        watchdog.start()
        # holds what it stops, never this runner: one dropped without close() is still collected
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, self.driver, watchdog, stop_r, stop_w)
        logger.info("tensor parallel: rank 0 (pid %d) and %d worker processes (pids %s), device %s",
                    os.getpid(), len(self.workers), ", ".join(str(w.process.pid) for w in self.workers),
                    config.device)

    def close(self) -> None:
        """Stop every worker, close the driver, leave the group (idempotent). Also done when the
        runner is garbage collected, and at exit."""
        self._finalizer()

    # ---- failures ---------------------------------------------------------------------------------

    def _record(self, dead: Worker | None, otherwise: str = "") -> None:
        """Keep the first failure: `dead`'s story, else `otherwise`."""
        with self._lock:
            if self.failure is None:
                self.failure = dead.why_dead() if dead is not None else otherwise

    def _terminate(self) -> None:
        _terminate(self.workers)

    def _step_fault(self, exc: BaseException) -> BaseException:
        """A failed step as the exception to raise: the dead rank's story when one died, else
        rank 0's fault made fatal (the ranks are out of step). The workers are stopped."""
        # a collective or a pipe that broke (gloo raises plain RuntimeErrors): a worker may be dying
        dead = self._await_death(_DEATH_GRACE_S if isinstance(exc, Exception) else 0)
        self._record(dead[0] if dead else None,
                     f"tensor-parallel rank 0: {describe_fault('a step', exc)}; the ranks are out of step")
        self._terminate()
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: keep them what they are
            return exc
        return FatalStepError(self.failure)

    def _await_death(self, timeout_s: float) -> list[Worker]:
        """The workers dead now or within `timeout_s` (a collective's error may precede the death;
        a sentinel may be ready a moment before the exit code is: join briefly)."""
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        dead = [by_sentinel[s] for s in connection.wait(list(by_sentinel), timeout_s)]
        for w in dead:
            w.process.join(1)
        return dead

    def _startup_fault(self, exc: BaseException) -> BaseException:
        """Start-up failed: rank 0's own refusal (ValueError, TypeError) or interrupt as it is;
        else (a collective broke) the story of the worker that died, if one does within a grace."""
        if isinstance(exc, (ValueError, TypeError)) or not isinstance(exc, Exception) or str(exc).startswith(
                "tensor-parallel start-up failed"):
            return exc
        dead = self._await_death(_DEATH_GRACE_S)
        return RuntimeError(f"tensor-parallel start-up failed: {dead[0].why_dead()}") if dead else exc

    def _abandon(self) -> None:
        """After a failed start-up: stop the workers, leave the group."""
        stop_workers(self.workers, 1)
        destroy_parallel()


def _watch(runner_ref: weakref.ref, workers: list[Worker], stop_r: int) -> None:
    """The watchdog thread: wait for the first worker death (or close()); then record it on the
    runner and stop the rest. It holds the runner weakly, so that an unclosed one is collected."""
    by_sentinel = {w.process.sentinel: w for w in workers}
    ready = connection.wait([*by_sentinel, stop_r])
    if stop_r in ready:
        return
    runner = runner_ref()
    if runner is None:  # collected: its finalizer stops the workers
        return
    runner._record(by_sentinel[ready[0]])
    logger.error("%s; stopping the other ranks", runner.failure)
    _terminate(workers)


def _reap(process, timeout_s: float) -> None:
    """Wait up to `timeout_s` for a process's exit code. Its sentinel closes as it exits, a moment
    before the kernel lets the parent collect the code (a busy machine stretches that moment), so
    one `join` after the sentinel may still find no code."""
    deadline = time.monotonic() + timeout_s
    process.join(timeout_s)
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.01)
        process.join(0)


def _terminate(workers: list[Worker]) -> None:
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()


def _shut_down(workers: list[Worker], driver: ModelRunner, watchdog: threading.Thread, stop_r: int,
               stop_w: int) -> None:
    """MultiprocRunner's finalizer (close(), collection or exit; runs once): stop the watchdog and
    every worker, close the driver, leave the group."""
    os.write(stop_w, b"x")  # the watchdog stops watching: these deaths are ours
    if watchdog is not threading.current_thread():  # collected on the watchdog thread: it is ending
        watchdog.join()
    try:
        stop_workers(workers, _JOIN_S)
        driver.close()
    finally:
        os.close(stop_r)
        os.close(stop_w)
        destroy_parallel()
