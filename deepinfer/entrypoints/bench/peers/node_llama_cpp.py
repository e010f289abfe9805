"""The llama.cpp peer of `deepinfer bench`: node-llama-cpp's prebuilt llama.cpp, driven from Python.

The npm package `node-llama-cpp` (pinned, NODE_LLAMA_CPP_VERSION) ships prebuilt llama.cpp
binaries and picks the CPU variant at run time (e.g. zen4 on an AVX-512 EPYC), so no source build
is needed. It is installed once into a cache directory (`install_dir()`: $DEEPINFER_NODE_LLAMA_CPP_DIR,
default ~/.cache/deepinfer/node-llama-cpp; `make peers` does the same) and driven by
`llama_cpp_peer.mjs` (package data beside this module): a JSON job on stdin (the workload's token
ids and output lengths), one JSON line of result on stdout.

Two modes, as engines: `llama.cpp` runs the requests one at a time; `llama.cpp-np16` runs 16
sequences in one context fed from a shared queue, so llama.cpp batches their decode steps (like
`llama-server -np 16`). Greedy, EOS ignored, exactly the workload's output lengths; only the
generation is timed (after the model load and a short warm-up).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from deepinfer.entrypoints.bench.common import BenchResult, Workload

NODE_LLAMA_CPP_VERSION = "3.21.1"  # exact pin: newer releases fail here
DIR_ENV = "DEEPINFER_NODE_LLAMA_CPP_DIR"
DEFAULT_DIR = Path("~/.cache/deepinfer/node-llama-cpp")
PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.mjs")
THREADS = 2  # the benchmark's convention
PARALLEL = 16  # sequences of the batched mode
CTX_ALIGN = 256  # llama.cpp pads a context to a multiple of 256 cells
ENGINE_SERIAL = "llama.cpp"
ENGINE_PARALLEL = f"llama.cpp-np{PARALLEL}"
# Never let node-llama-cpp download llama.cpp's source (its postinstall and getLlama honour this).
NODE_ENV = {"NODE_LLAMA_CPP_SKIP_DOWNLOAD": "true"}
INSTALL_TIMEOUT_S = 900
RUN_TIMEOUT_S = 3600


class PeerSetupError(ValueError):
    """node, npm or the npm package is missing, or the install failed (the CLI prints it as an error)."""


def install_dir() -> Path:
    """Where node-llama-cpp is (or will be) installed: $DEEPINFER_NODE_LLAMA_CPP_DIR or the default."""
    return Path(os.environ.get(DIR_ENV) or DEFAULT_DIR).expanduser()


def install_command(directory: Path) -> list[str]:
    """The npm command that installs the pinned node-llama-cpp into `directory`."""
    return ["npm", "i", "-E", "--prefix", str(directory), f"node-llama-cpp@{NODE_LLAMA_CPP_VERSION}"]


def installed_version(directory: Path) -> str | None:
    """The version of node-llama-cpp under `directory`, or None when it is not installed."""
    try:
        package = json.loads((directory / "node_modules" / "node-llama-cpp" / "package.json").read_text())
    except (OSError, ValueError):
        return None
    return package.get("version")


def _which(tool: str, directory: Path) -> str:
    path = shutil.which(tool)
    if path is None:
        raise PeerSetupError(f"the llama.cpp peer needs `{tool}` (Node.js >= 20 with npm) on PATH, which has none; "
                             f"install Node.js, then run `{' '.join(install_command(directory))}` (or `make peers`)")
    return path


def ensure_installed(directory: Path | None = None) -> Path:
    """Install the pinned node-llama-cpp into `directory` (default `install_dir()`) unless it is
    there already; returns the directory. Raises PeerSetupError naming the command on failure."""
    directory = install_dir() if directory is None else directory
    if installed_version(directory) == NODE_LLAMA_CPP_VERSION:
        return directory
    cmd = install_command(directory)
    cmd[0] = _which("npm", directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              env=os.environ | NODE_ENV)
    except subprocess.TimeoutExpired as exc:
        command = " ".join(install_command(directory))
        raise PeerSetupError(f"`{command}` did not finish in {INSTALL_TIMEOUT_S} s") from exc
    version = installed_version(directory)
    if proc.returncode != 0 or version != NODE_LLAMA_CPP_VERSION:
        raise PeerSetupError(f"`{' '.join(install_command(directory))}` failed (exit {proc.returncode}, installed "
                             f"version {version!r}): {_tail(proc.stderr or proc.stdout)}")
    return directory


def context_size(workload: Workload) -> int:
    """Tokens per sequence: the longest request (prompt + output), rounded up to CTX_ALIGN."""
    need = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    return -(-need // CTX_ALIGN) * CTX_ALIGN


def build_job(model_path: str, workload: Workload, parallel: int, threads: int = THREADS, **extra) -> dict:
    """The JSON job of the .mjs peer for `workload` (its token ids as is; outputs of exactly
    `output_lens` tokens, so the workload must ignore EOS)."""
    if not workload.ignore_eos:
        raise ValueError(f"the llama.cpp peer generates exactly output_lens tokens: workload {workload.name!r} "
                         "has ignore_eos=False")
    if parallel < 1 or threads < 1:
        raise ValueError(f"parallel and threads must be >= 1, got parallel={parallel!r}, threads={threads!r}")
    return {"model_path": str(model_path), "threads": threads, "prompts": [list(p) for p in workload.prompts],
            "output_lens": list(workload.output_lens), "parallel": parallel, "ctx_size": context_size(workload),
            **extra}  # extra: the .mjs's optional fields (depths, flash_attention, draft_model_path, ...)


def engine_name(parallel: int) -> str:
    """`llama.cpp` one request at a time, `llama.cpp-npN` with N parallel sequences."""
    return ENGINE_SERIAL if parallel == 1 else f"llama.cpp-np{parallel}"


def parse_result(stdout: str, workload: Workload, parallel: int) -> tuple[BenchResult, dict]:
    """The peer's JSON line (the last line of `stdout` that is a JSON object) as a BenchResult,
    and the whole object (versions, CPU variant). Raises if it is missing or fell short."""
    lines = [line for line in stdout.splitlines() if line.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"the llama.cpp peer printed no JSON result; its stdout ends with: {_tail(stdout)!r}")
    info = json.loads(lines[-1])
    for field in ("seconds", "output_tokens"):
        if not isinstance(info.get(field), int | float) or info[field] <= 0:
            raise RuntimeError(f"the llama.cpp peer's result field {field} must be a positive number, "
                               f"got {info.get(field)!r}")
    if info["output_tokens"] != workload.num_output_tokens:
        raise RuntimeError(f"the llama.cpp peer produced output_tokens={info['output_tokens']}, "
                           f"expected {workload.num_output_tokens}")
    result = BenchResult(engine_name(parallel), workload.name, float(info["seconds"]), info["output_tokens"],
                         batch=parallel)
    return result, info


def run_job(job: dict, directory: Path, timeout: float = RUN_TIMEOUT_S) -> str:
    """Run the .mjs peer on `job` (JSON on stdin); returns its stdout. Raises with its stderr's tail on failure."""
    node = _which("node", directory)
    try:
        proc = subprocess.run([node, str(PEER_SCRIPT), str(directory)], input=json.dumps(job), capture_output=True,
                              text=True, timeout=timeout, env=os.environ | NODE_ENV)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the llama.cpp peer did not finish in {timeout} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"the llama.cpp peer failed (exit {proc.returncode}): {_tail(proc.stderr)}")
    return proc.stdout


def run_node_llama_cpp(model_path: str, workload: Workload, parallel: int = 1, threads: int = THREADS,
                       directory: Path | None = None, **extra) -> tuple[BenchResult, dict]:
    """Measure `workload` in node-llama-cpp (installed first if needed) with `parallel` sequences
    (`extra`: the job's optional fields); returns the result and the peer's JSON object."""
    _which("node", install_dir() if directory is None else directory)
    directory = ensure_installed(directory)
    stdout = run_job(build_job(model_path, workload, parallel, threads, **extra), directory)
    return parse_result(stdout, workload, parallel)


def describe(info: dict) -> str:
    """One line on what ran: versions, build, CPU variant, threads and sequences."""
    parallel = info.get("parallel", 1)
    sequences = "one sequence" if parallel == 1 else f"{parallel} parallel sequences"
    fa = {True: ", flash attention on", False: ", flash attention off"}.get(info.get("flash_attention"), "")
    draft = f", draft model {os.path.basename(info['draft_model_path'])}" if info.get("draft_model_path") else ""
    return (f"peer     {engine_name(parallel)}: node-llama-cpp {info.get('node_llama_cpp_version')}, "
            f"llama.cpp {info.get('llama_cpp_release')} ({info.get('build_type')}, CPU variant "
            f"{info.get('cpu_variant')}), {info.get('threads')} threads, {sequences} of {info.get('ctx_size')} "
            f"tokens{fa}{draft}")


def node_available() -> bool:
    """Whether `node` is on PATH."""
    return shutil.which("node") is not None


def _tail(text: str, limit: int = 2000) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else "..." + text[-limit:]
