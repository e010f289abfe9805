"""`torchrun ... -m deepinfer.entrypoints.cli generate --tensor-parallel-size N` (`worker/torchrun.py`):
two processes on the CPU (gloo) print tp=1's greedy text once, from rank 0, and exit 0; a size that
is not WORLD_SIZE is refused naming both; a follower that dies ends the job; the torchrun environment
is read and checked."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from deepinfer.worker.torchrun import TorchrunJob, torchrun_job

pytestmark = [pytest.mark.multirank]

FLAGS = ["--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--raw", "--device", "cpu",
         "--max-model-len", "64", "--num-blocks", "16"]
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


def _clean_env() -> dict[str, str]:
    """This environment without torchrun's variables, with one thread per rank (2 busy cores)."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    return {**env, "OMP_NUM_THREADS": "1"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=120, env=_clean_env())


def _torchrun(*args: str, script: str | None = None) -> subprocess.CompletedProcess:
    """torchrun --standalone, two ranks on this machine, of `script` (else the CLI); every rank
    writes to the same stdout."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    target = [script] if script else ["-m", "deepinfer.entrypoints.cli"]
    return subprocess.run([*launcher, *target, *args], capture_output=True, text=True, timeout=120,
                          env=_clean_env())


@pytest.fixture(scope="module")
def llama(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.mark.subprocess
def test_two_torchrun_ranks_print_one_ranks_text_once_from_rank_0(llama):
    one = _cli("generate", "hello world", "--model", llama, *FLAGS)
    assert one.returncode == 0, one.stderr
    assert one.stdout.strip()
    two = _torchrun("generate", "hello world", "--model", llama, *FLAGS, "--tensor-parallel-size", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout  # once: the follower printed nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_node_agents(*args: str) -> list[subprocess.CompletedProcess]:
    """Two torchrun node agents on loopback (`--nnodes 2`, `--node-rank` 0 and 1, one process each),
    the static rendezvous of a multi-node launch: each agent is started as it would be on its own
    machine, with only MASTER_ADDR:PORT in common."""
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                                str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                                "--master-port", str(port), "-m", "deepinfer.entrypoints.cli", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())
              for node in (0, 1)]
    results = []
    for agent in agents:
        out, err = agent.communicate(timeout=180)
        results.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    return results


@pytest.mark.subprocess
def test_two_nodes_with_one_rank_each_equal_one_rank_token_for_token(llama):
    """torchrun --nnodes 2: RANK 1 has LOCAL_RANK 0 on its node; tensor parallelism across the two
    nodes prints what one rank prints, once, from node 0."""
    one = _cli("generate", "hello world", "--model", llama, *FLAGS, "--max-tokens", "12")
    assert one.returncode == 0, one.stderr
    node0, node1 = _two_node_agents("generate", "hello world", "--model", llama, *FLAGS, "--max-tokens", "12")
    assert node0.returncode == 0 and node1.returncode == 0, (node0.stderr[-3000:], node1.stderr[-3000:])
    assert node0.stdout == one.stdout
    assert node1.stdout == ""  # the follower node prints nothing of the command's output


@pytest.mark.subprocess
def test_a_size_other_than_world_size_is_refused_naming_both(llama):
    res = _torchrun("generate", "hi", "--model", llama, *FLAGS, "--tensor-parallel-size", "3")
    assert res.returncode != 0
    assert "--tensor-parallel-size 3" in res.stderr and "WORLD_SIZE=2" in res.stderr


_DYING_FOLLOWER = """
import os, sys
from deepinfer import LLM, SamplingParams
from deepinfer.worker.step_executor import StepExecutor

if os.environ["RANK"] == "1":  # the follower dies in its second step
    steps, real = [], StepExecutor.follow
    StepExecutor.follow = lambda s, p, *a: os._exit(7) if steps.append(p) or len(steps) == 2 else real(s, p, *a)
llm = LLM(sys.argv[1], device="cpu", max_model_len=64, num_blocks=16)  # rank 1 serves rank 0's steps in here
print("runner", type(llm.engine.runner).__name__, flush=True)
llm.generate([[3, 4, 5, 6]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
"""


@pytest.mark.subprocess
def test_a_dying_follower_ends_the_job_and_only_rank_0_ran_the_script_body(llama, tmp_path):
    script = tmp_path / "dying_follower.py"
    script.write_text(_DYING_FOLLOWER)
    res = _torchrun(llama, script=str(script))  # a hang would raise TimeoutExpired
    assert res.stdout.splitlines() == ["runner TorchrunRunner"]  # the LLM API: tp = WORLD_SIZE, rank 0 only
    assert res.returncode != 0 and re.search(r"exitcode\s*:\s*7", res.stderr)  # torchrun names the death
    # rank 0's step fails at once with a FatalStepError (gloo sees the connection drop) or torchrun's
    # SIGTERM ends it first: which one wins is a race, so only the end of the job is asserted


def test_the_torchrun_environment_is_read_and_checked():
    assert torchrun_job({}) is None
    assert torchrun_job({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == TorchrunJob(1, 4, 1)
    with pytest.raises(ValueError, match="WORLD_SIZE=None is not an integer"):
        torchrun_job({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK=4 outside WORLD_SIZE=4"):
        torchrun_job({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    job = TorchrunJob(0, 2, 0)
    assert job.tensor_parallel_size(1) == 2 and job.tensor_parallel_size(2) == 2  # 1: the default
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 .* WORLD_SIZE=2"):
        job.tensor_parallel_size(3)
    assert job.device("cpu") == "cpu"
