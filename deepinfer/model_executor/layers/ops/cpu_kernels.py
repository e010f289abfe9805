"""The CPU kernel library (`fused_cpu.cpp`, `qdot_cpu.cpp` and `qdot_avx2_cpu.cpp`, `iq_grid_cpu.cpp`,
`invariant_cpu.cpp`, `mxfp4_cpu.cpp`, `lora_cpu.cpp`): built once per content with
`torch.utils.cpp_extension` (the system's C++ compiler and ninja) and loaded on first use.

`make run` / `make test` build it at install time (`python -m deepinfer.model_executor.layers.ops.cpu_kernels`);
a process that finds no build builds it then (tens of seconds). Where it cannot be built (no
compiler, no AVX2) `kernel_isa()` is 0 and callers use their plain-torch paths; the reason is
logged once and kept in `kernel_status()`.

The build cache is `DEEPINFER_KERNEL_CACHE` (default `$XDG_CACHE_HOME/deepinfer/kernels`, else
`~/.cache/deepinfer/kernels`). Each build has its own folder there, `<name>-<key>`, where the key
hashes the sources (names and bytes), the compiler (`$CXX` or `c++`: its path and `--version`), the
flags, torch's version and C++ ABI and the Python ABI. The folder holds a copy of the sources
(`src/`), ninja's work (`build/`), the finished library (`<name>.so`, moved there only once
complete), `build.lock`, and after a failed build `build-failed.log`. Two checkouts or two venvs
with the same torch therefore share one build and never rebuild each other, and a process that
finds the `.so` loads it directly (`torch.ops.load_library`) without running ninja.

One process builds and logs one line on the `deepinfer.kernels` logger (WARNING); the others log
one line naming the lock file and its holder's pid, wait, then load its library. The lock is an
`fcntl.flock` on `build.lock`, which the OS releases when its holder dies, so the lock of a killed
build is taken over at once (and torch's own `build/lock` it left behind is removed). A failed
build is not retried for `FAILURE_RETRY_S` by processes that only load the kernels; the
`python -m` build above always retries.

`DEEPINFER_CPU_ISA` (read once per process) caps the instruction set the kernels use, e.g. to run
the AVX2 path on an AVX-512 machine, or none at all. The integer dot products (`qdot_level`) and
the other kernels (`kernel_isa`) read it as:

    avx512_vnni, avx512   qdot AVX512-VNNI   others AVX-512   (the default: the best this CPU runs)
    avx_vnni              qdot AVX-VNNI      others AVX2
                          (each: or the best variant below it that this CPU runs)
    avx2                  qdot AVX2          others AVX2
    plain                 qdot portable C++  others plain torch (no instruction-set-specific code)
    none                  torch reference everywhere (the library is not even loaded)
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger("deepinfer.kernels")

_SOURCES = [os.path.join(os.path.dirname(__file__), name)
            for name in ("qdot_cpu.cpp", "qdot_avx2_cpu.cpp", "fused_cpu.cpp", "invariant_cpu.cpp", "mxfp4_cpu.cpp",
                         "lora_cpu.cpp", "work_pool.cpp", "iq_grid_cpu.cpp")]  # the two longest compiles first
_LIB_NAME = "deepinfer_cpu"
_ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512"}
_QDOT_NAMES = {0: "none", 1: "plain", 2: "avx2", 3: "avx_vnni", 4: "avx512_vnni"}
# DEEPINFER_CPU_ISA -> (cap of kernel_isa, cap of qdot_level)
_CAPS = {"none": (0, 0), "plain": (0, 1), "avx2": (1, 2), "avx_vnni": (1, 3), "avx512": (2, 4), "avx512_vnni": (2, 4)}
# -fno-trapping-math: nothing here reads floating-point exception flags, and it lets the compiler
# vectorize loops with selects (fused_cpu.cpp's exp).
_CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-fno-trapping-math"]
_LDFLAGS = ["-fopenmp"]
FAILURE_RETRY_S = 3600
_FAILURE_LOG = "build-failed.log"
_FIX_HINT = ("to fix: install a C++ compiler and ninja (apt-get install build-essential ninja-build), then run "
             "`python -m deepinfer.model_executor.layers.ops.cpu_kernels`; or set DEEPINFER_CPU_ISA=none to skip")
_LOADED: set[str] = set()
_retry_failed_build = False  # set by main(): the install step retries a failed build


class KernelBuildError(RuntimeError):
    """A kernel library that could not be built or loaded; the message says why (and where the log is)."""


def kernel_cache_dir() -> str:
    """`$DEEPINFER_KERNEL_CACHE`, else `$XDG_CACHE_HOME/deepinfer/kernels`, else `~/.cache/deepinfer/kernels`
    (empty variables count as unset)."""
    explicit = os.environ.get("DEEPINFER_KERNEL_CACHE")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = os.path.abspath(os.path.expanduser(xdg)) if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepinfer", "kernels")


def _compiler() -> list[str]:
    """[path, `--version` output] of the compiler `cpp_extension` uses (`$CXX`, else `c++`)."""
    name = os.environ.get("CXX") or "c++"
    path = shutil.which(name)
    if path is None:
        raise KernelBuildError(f"no C++ compiler: {name!r} (CXX) is not on PATH")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"the C++ compiler {path} does not run: {exc}") from exc
    return [path, version]


def _read_sources(sources: Sequence[str]) -> dict[str, bytes]:
    """{file name: bytes} of the sources; their names must differ (they are copied into one folder)."""
    contents: dict[str, bytes] = {}
    for source in sources:
        name = os.path.basename(source)
        if name in contents:
            raise ValueError(f"sources must have distinct file names; got {name!r} twice in {list(sources)}")
        with open(source, "rb") as f:
            contents[name] = f.read()
    return contents


def _build_key(contents: dict[str, bytes], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """16 hex digits naming one build: sources, compiler, flags, torch and Python ABI."""
    abi = [torch.__version__, str(torch.compiled_with_cxx11_abi()), sys.implementation.cache_tag,
           str(sysconfig.get_config_var("EXT_SUFFIX")), platform.machine()]
    digest = hashlib.sha256("\0".join([*_compiler(), *cflags, "|", *ldflags, "|", *abi]).encode())
    for name in sorted(contents):
        digest.update(f"\0{name}\0{len(contents[name])}\0".encode())
        digest.update(contents[name])
    return digest.hexdigest()[:16]


def library_folder(name: str, sources: Sequence[str], cflags: Sequence[str] = (),
                   ldflags: Sequence[str] = ()) -> str:
    """The cache folder of the build of library `name` from `sources` with these flags."""
    return os.path.join(kernel_cache_dir(), f"{name}-{_build_key(_read_sources(sources), cflags, ldflags)}")


def load_library(name: str, sources: Sequence[str], cflags: Sequence[str] = (), ldflags: Sequence[str] = (),
                 *, retry_failed: bool = False) -> str:
    """Load the C++ library `name` built from `sources` (a torch extension without Python bindings),
    building it first when the cache holds no build of this content; returns the library's path.

    Raises KernelBuildError when no compiler runs, the build fails (the message names the log), or
    a build failed less than FAILURE_RETRY_S ago and `retry_failed` is false."""
    contents = _read_sources(sources)
    folder = os.path.join(kernel_cache_dir(), f"{name}-{_build_key(contents, cflags, ldflags)}")
    library = os.path.join(folder, f"{name}.so")
    if library in _LOADED:
        return library
    if not os.path.exists(library):
        _check_failure(folder, retry_failed)
        os.makedirs(folder, exist_ok=True)
        with _build_lock(os.path.join(folder, "build.lock"), name):
            if not os.path.exists(library):
                _check_failure(folder, retry_failed)
                _build(name, contents, cflags, ldflags, folder)
    if library not in _LOADED:
        torch.ops.load_library(library)
        _LOADED.add(library)
    return library


def _check_failure(folder: str, retry_failed: bool) -> None:
    log = os.path.join(folder, _FAILURE_LOG)
    with contextlib.suppress(FileNotFoundError):
        age = time.time() - os.stat(log).st_mtime
        if not retry_failed and age < FAILURE_RETRY_S:
            raise KernelBuildError(f"the build failed {age:.0f} s ago, not retried for {FAILURE_RETRY_S} s; log: {log}")


@contextlib.contextmanager
def _build_lock(path: str, name: str) -> Iterator[None]:
    """Hold an exclusive flock on `path` (released by the OS if this process dies); says once when it waits."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown pid"
            logger.warning("waiting for another process's build of CPU kernels (%s): lock %s held by %s",
                           name, path, holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)


def _build(name: str, contents: dict[str, bytes], cflags: Sequence[str], ldflags: Sequence[str],
           folder: str) -> None:
    """Build `<folder>/<name>.so` from a copy of the sources; the caller holds the folder's lock."""
    from torch.utils import cpp_extension

    logger.warning("building CPU kernels (%s) for this CPU, one time, ~30 s, in %s", name, folder)
    src_dir, build_dir = os.path.join(folder, "src"), os.path.join(folder, "build")
    os.makedirs(src_dir, exist_ok=True)
    os.makedirs(build_dir, exist_ok=True)
    copies = []
    for file_name, data in contents.items():
        copies.append(os.path.join(src_dir, file_name))
        with open(copies[-1], "wb") as f:
            f.write(data)
    baton = os.path.join(build_dir, "lock")  # torch's own lock: left only by a killed build, as we hold ours
    if os.path.exists(baton):
        logger.info("removing %s, left by a build that was killed", baton)
        os.remove(baton)
    started = time.monotonic()
    try:
        built = cpp_extension.load(name=name, sources=copies, extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                                   build_directory=build_dir, is_python_module=False, verbose=False)
    except Exception as exc:
        log = os.path.join(folder, _FAILURE_LOG)
        with open(log, "w") as f:
            f.write(f"build of {name} failed in pid {os.getpid()} on {socket.gethostname()} at {time.ctime()}\n"
                    f"{type(exc).__name__}: {exc}\n")
        raise KernelBuildError(f"the build failed ({_last_line(exc)}); log: {log}") from exc
    library = os.path.join(folder, f"{name}.so")
    os.replace(built, library)  # already loaded from `built` by cpp_extension.load
    _LOADED.add(library)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, _FAILURE_LOG))
    logger.info("built %s in %.0f s", library, time.monotonic() - started)


def _last_line(exc: BaseException) -> str:
    """The exception's type and its first compiler error line, else its last line."""
    lines = str(exc).strip().splitlines() or [""]
    errors = [line for line in lines if "error:" in line]
    return f"{type(exc).__name__}: {(errors or lines[-1:])[0].strip()[:200]}"


@functools.cache
def _load() -> tuple[int, str]:
    """(isa the library can run here, status line); builds the library if needed."""
    try:
        load_library(_LIB_NAME, _SOURCES, _CFLAGS, _LDFLAGS, retry_failed=_retry_failed_build)
        isa = int(torch.ops.deepinfer_cpu.cpu_isa())
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
        message = str(exc) if isinstance(exc, KernelBuildError) else _last_line(exc)
        status = f"CPU kernels unavailable ({message})"
        logger.warning("%s; quantized weights use the plain-torch path; %s", status, _FIX_HINT)
        return 0, status
    return isa, f"CPU kernels built for this CPU: {_ISA_NAMES[isa]}"


def set_kernel_threads(num_threads: int) -> None:
    """The thread count of the kernels' pool (`work_pool.cpp`) for every calling thread; 0: each
    call takes torch's count of its calling thread (the default). No-op without the library."""
    if kernel_isa():
        torch.ops.deepinfer_cpu.set_pool_threads(num_threads)


def _caps() -> tuple[int, int]:
    """(kernel_isa cap, qdot_level cap) from DEEPINFER_CPU_ISA."""
    name = os.environ.get("DEEPINFER_CPU_ISA", "avx512_vnni").strip().lower()
    if name not in _CAPS:
        raise ValueError(f"DEEPINFER_CPU_ISA must be one of {', '.join(_CAPS)}; got {name!r}")
    return _CAPS[name]


def _isa_cap() -> int:
    return _caps()[0]


@functools.cache
def kernel_isa() -> int:
    """The instruction set the quantized kernels use: 2 AVX-512, 1 AVX2, 0 none (plain torch).

    Decided once per process (`kernel_isa.cache_clear()` makes the next call read
    DEEPINFER_CPU_ISA again)."""
    cap = _isa_cap()
    return 0 if cap == 0 else min(_load()[0], cap)


def kernel_isa_name() -> str:
    return _ISA_NAMES[kernel_isa()]


@functools.cache
def qdot_levels() -> tuple[int, ...]:
    """The integer dot-product variants (qdot_cpu.cpp) this CPU and build run, ascending: 1 portable
    C++, 2 AVX2, 3 AVX-VNNI, 4 AVX512-VNNI (not nested: AVX512-VNNI CPUs may lack AVX-VNNI);
    () without the library. Ignores DEEPINFER_CPU_ISA."""
    _load()
    try:
        mask = int(torch.ops.deepinfer_cpu.qdot_cpu_isas())
    except (AttributeError, RuntimeError):  # no library
        return ()
    return tuple(level for level in sorted(_QDOT_NAMES) if level and mask >> level & 1)


@functools.cache
def qdot_level(cap: bool = True) -> int:
    """The integer dot-product variant this process uses: the best of `qdot_levels()` at or below
    DEEPINFER_CPU_ISA's cap (all of them if `cap` is false); 0 none (the torch reference). Decided
    once per process (`qdot_level.cache_clear()` makes the next call read DEEPINFER_CPU_ISA again)."""
    limit = _caps()[1] if cap else max(_QDOT_NAMES)
    if not limit:
        return 0
    level = max((level for level in qdot_levels() if level <= limit), default=0)
    if cap and level == 1:  # the one line a user sees (at start-up: the first quantized matmul asks)
        logger.warning("integer dot products run the portable C++ path (%s): decode is several times slower "
                       "than with AVX2", portable_reason())
    return level


def portable_reason() -> str:
    """Why the portable path runs: the CPU, or DEEPINFER_CPU_ISA's cap."""
    if not qdot_simd_available():
        return "this CPU has neither AVX2 nor AVX-512"
    return f"DEEPINFER_CPU_ISA={os.environ.get('DEEPINFER_CPU_ISA', '')} caps it"


def qdot_simd_available() -> bool:
    """Whether this CPU and build run an AVX2 or wider integer dot product (whatever the cap)."""
    return any(level >= 2 for level in qdot_levels())


def kernel_status() -> str:
    """One line: what was built and what runs (for `deepinfer info` and logs)."""
    isa, status = _load() if _caps()[1] else (0, "CPU kernels off (DEEPINFER_CPU_ISA=none)")
    if kernel_isa() != isa:
        status = f"{status}; capped to {kernel_isa_name()} by DEEPINFER_CPU_ISA"
    return f"{status}; integer dot products: {_QDOT_NAMES[qdot_level()]}"


def main() -> int:
    """Build the library now (the Makefile's install step; a failed build is retried); exit status 0
    even without one."""
    global _retry_failed_build
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _retry_failed_build = True
    print(kernel_status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
