"""The multi-process executor (`worker/multiproc.py`): LLM(tensor_parallel_size=2) on the CPU (gloo)
gives tp=1's greedy tokens and logprobs through chunked prefill and preemption with no block
leaks; a worker that dies or raises makes the parent raise naming the rank; no process outlives
close()."""

from __future__ import annotations

import os
import signal
import time

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import FatalStepError
from deepinfer.worker import multiproc
from deepinfer.worker.model_runner import ModelRunner
from deepinfer.worker.step_executor import StepExecutor

pytestmark = [pytest.mark.multirank]

# few blocks (12 of 4 tokens: one request at max_model_len 48; the three below grow to 17) and
# 8-token steps: chunked prefill, and preemption
TIGHT = dict(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=48)
PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 11)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)


def _workers(llm: LLM) -> list:
    return [w.process for w in llm.engine.runner.workers]


def _assert_all_gone(processes, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        assert not p.is_alive(), f"worker pid {p.pid} is still alive"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(llama):
    llm = LLM(llama, **TIGHT)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.get_metrics()["num_preemptions"] > 0  # the settings above force it
    llm.close()
    return out


def test_two_ranks_equal_one_rank_with_chunked_prefill_and_preemption(llama, reference):
    with LLM(llama, tensor_parallel_size=2, **TIGHT) as llm:
        assert isinstance(llm.engine.runner, multiproc.MultiprocRunner)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert llm.get_metrics()["num_preemptions"] > 0
        llm.engine.kv_manager.check_no_leaks()
        workers = _workers(llm)
    _assert_all_gone(workers)
    _assert_same(out, reference)


def _assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        g_lp = [lp[t].logprob for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids, strict=True)]
        w_lp = [lp[t].logprob for lp, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids, strict=True)]
        assert g_lp == pytest.approx(w_lp, abs=1e-4)


def _v4_checkpoint(tmp_path_factory) -> str:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "models" / "deepseek_v4"))
    from v4_tiny import CSA, HCA, SLIDING, make_tiny_v4

    path = str(tmp_path_factory.mktemp("v4-executor"))
    make_tiny_v4(path, [SLIDING, CSA, HCA])
    return path


# DeepSeek-V4's caches (compressed rows, index rows, rings) take more room: 2-row blocks
V4_TIGHT = dict(num_blocks=24, block_size=2, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=75)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "deepseek_v4"])
def test_more_models_at_two_ranks_equal_one_rank_with_preemption(arch, tiny_checkpoint, tmp_path_factory):
    """Qwen3 (one KV head, replicated), Gemma 3 (ring layers) and DeepSeek-V4 (sliding, CSA, HCA;
    expert_parallel_size 2) through the whole engine with chunked prefill and forced preemption."""
    if arch == "deepseek_v4":  # longer answers, to outgrow the 24 blocks
        path, settings, parallel = _v4_checkpoint(tmp_path_factory), V4_TIGHT, {"expert_parallel_size": 2}
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)
    else:
        path, settings, parallel, params = tiny_checkpoint(arch, num_key_value_heads=1), TIGHT, {}, GREEDY
    prompts = [[3 + (7 * i + n) % 200 for i in range(n)] for n in (5, 17, 11)]
    runs = []
    for ranks in ({}, {"tensor_parallel_size": 2, **parallel}):
        with LLM(path, dtype="float32", **settings, **ranks) as llm:
            runs.append(llm.generate(prompts, params, use_tqdm=False))
            assert llm.get_metrics()["num_preemptions"] > 0
            llm.engine.kv_manager.check_no_leaks()
    _assert_same(runs[1], runs[0])


def test_a_killed_worker_makes_the_next_generate_raise_naming_its_rank(llama):
    llm = LLM(llama, tensor_parallel_size=2, max_model_len=48)
    workers = _workers(llm)
    os.kill(workers[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(FatalStepError, match=r"rank 1 \(pid \d+\) died: exit code -9 \(SIGKILL\)"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    # named by the watchdog, not found when the step's collective times out (COLLECTIVE_TIMEOUT_S, 300 s):
    # a bound that tells the two apart however busy the machine (a speed bound would not)
    assert time.monotonic() - start < multiproc.COLLECTIVE_TIMEOUT_S / 3
    _assert_all_gone(workers)
    with pytest.raises(FatalStepError, match="rank 1"):  # it stays broken
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.close()


def test_close_stops_every_worker_and_a_new_run_can_start(llama):
    llm = LLM(llama, tensor_parallel_size=2, max_model_len=48)
    workers = _workers(llm)
    assert all(p.is_alive() for p in workers)
    llm.close()
    _assert_all_gone(workers, within_s=0)  # close() waits for them
    llm.close()  # idempotent
    with LLM(llama, max_model_len=48) as one:  # the process group is gone: one rank again
        assert isinstance(one.engine.runner, ModelRunner)
        assert one.generate(PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)


# ---- workers that fail (spawned: these run in the child; the test module is importable there) -----------


def _failing_start(rank, world_size, init_method, config, plans, status):
    def refuse(*args, **kwargs):
        raise ValueError(f"injected start-up fault on rank {rank}")

    multiproc.ModelRunner = refuse
    multiproc.worker_main(rank, world_size, init_method, config, plans, status)


def _failing_step(rank, world_size, init_method, config, plans, status):
    real = StepExecutor.follow

    def follow(self, plan, *args):
        if any(s.start_pos > 0 for s in plan.scheduled):
            raise RuntimeError(f"injected step fault on rank {rank}")
        return real(self, plan, *args)

    StepExecutor.follow = follow
    multiproc.worker_main(rank, world_size, init_method, config, plans, status)


def test_a_worker_start_up_error_comes_back_with_its_text(llama, monkeypatch):
    monkeypatch.setattr(multiproc.MultiprocRunner, "worker_target", staticmethod(_failing_start))
    started = []
    real_start = multiproc.start_workers
    monkeypatch.setattr(multiproc, "start_workers", lambda *a: started.extend(real_start(*a)) or started)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 \(pid \d+\) died: exit code 1.*"
                                           r"ValueError: injected start-up fault on rank 1"):
        LLM(llama, tensor_parallel_size=2, max_model_len=48)
    _assert_all_gone([w.process for w in started])
    with LLM(llama, max_model_len=48) as one:  # the group was left: one rank works
        assert one.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_worker_step_error_is_fatal_and_names_the_rank(llama, monkeypatch):
    monkeypatch.setattr(multiproc.MultiprocRunner, "worker_target", staticmethod(_failing_step))
    llm = LLM(llama, tensor_parallel_size=2, max_model_len=48)
    workers = _workers(llm)
    with pytest.raises(FatalStepError, match="(?s)rank 1.*RuntimeError: injected step fault on rank 1"):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    _assert_all_gone(workers)
    llm.close()


def test_parallel_sizes_are_checked_before_anything_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer, got 0"):
        LLM(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="expert_parallel_size=2 must divide tensor_parallel_size=3"):
        LLM(tensor_parallel_size=3, expert_parallel_size=2)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: only 1 is supported"):
        LLM(pipeline_parallel_size=2)


def test_the_cli_flags_reach_the_engine_config():
    import argparse

    from deepinfer.entrypoints.engine_args import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--tensor-parallel-size", "2", "--expert-parallel-size", "1"])
    kwargs = engine_kwargs(args)
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["expert_parallel_size"] == 1
    assert engine_kwargs(p.parse_args([]))["tensor_parallel_size"] == 1


_PARENT = """
import sys, time
from deepinfer import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=48)
print(*[w.process.pid for w in llm.engine.runner.workers], flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaped yet (its code no longer runs)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.subprocess
@pytest.mark.parametrize("end", ["exit", "sigterm"])
def test_no_worker_outlives_its_parent(llama, end):
    """The parent ends without close(): at exit (atexit stops the workers), or by SIGTERM (each
    worker reads EOF from its plan pipe and leaves)."""
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, llama, "wait" if end == "sigterm" else "end"],
                              stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 1
    if end == "sigterm":
        parent.send_signal(signal.SIGTERM)
    parent.wait(60)
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


_KILLED_WHILE_JOINING = """
import os, signal, sys
import torch.multiprocessing as mp
from deepinfer.config import EngineConfig
from deepinfer.worker.multiproc import free_init_method, worker_main

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    plans, _ = ctx.Pipe(duplex=False)
    status_read, status_write = ctx.Pipe(duplex=False)
    args = (1, 2, free_init_method(), EngineConfig(model=sys.argv[1], device="cpu"), plans, status_write)
    worker = ctx.Process(target=worker_main, args=args)
    worker.start()
    assert status_read.recv()[0] == "joining"
    print(worker.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 never joins: the worker waits in the rendezvous
"""


@pytest.mark.subprocess
def test_a_worker_waiting_to_join_ends_with_its_killed_parent(llama, tmp_path):
    """Killed before it opened the rendezvous, the parent leaves a worker blocked in it (until the
    collective timeout, minutes); the worker notices its parent is gone and exits within seconds."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_KILLED_WHILE_JOINING)
    parent = subprocess.Popen([sys.executable, str(script), llama], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    assert parent.wait(60) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)
