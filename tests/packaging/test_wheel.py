"""The wheel works outside the checkout: built with `python -m build` (sdist, then the wheel from the
sdist, as `make dist` does), installed with `pip install --no-deps` into a fresh venv outside the
repository, and run from a directory outside it.

The fresh venv sees the dependencies already installed here through one `.pth` line naming this
interpreter's site-packages as a plain path: a path line adds the directory to `sys.path` without
processing the `.pth` files inside it, so the checkout's editable install stays invisible and
`import deepinfer` can only find the wheel's copy.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.subprocess]

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "deepinfer"
# Every file the package opens by path at run time (next to its modules), as globs under deepinfer/.
DATA_GLOBS = ("model_executor/layers/ops/*.cpp", "entrypoints/openai/static/**/*", "entrypoints/bench/peers/*.mjs")
PROBE = ("import deepinfer\n"
         "from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_status\n"
         "print(deepinfer.__file__)\n"
         "print(kernel_status())\n")


def _data_files() -> list[str]:
    """The package's data files in the checkout, as wheel entry names (deepinfer/...)."""
    found = {p for pattern in DATA_GLOBS for p in PACKAGE.glob(pattern) if p.is_file()}
    return sorted(p.relative_to(REPO).as_posix() for p in found if "__pycache__" not in p.parts)


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would point Python back at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", **extra}


def _run(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run `args`; return stdout, or fail showing both streams."""
    done = subprocess.run(args, cwd=cwd, env=env or _clean_env(), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{args[:3]} exited {done.returncode}\nstdout:\n{done.stdout[-3000:]}\n"
                    f"stderr:\n{done.stderr[-3000:]}")
    return done.stdout


def _venv_site_packages(root: Path) -> Path:
    """purelib of the venv at `root` (the same scheme as this interpreter's)."""
    return Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))


def _snapshot(folder: Path) -> dict[str, int]:
    """{relative path: size} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _set_writable(folder: Path, writable: bool) -> None:
    """Add or take away the write bits of `folder` and everything under it."""
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for path in [folder, *folder.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~bits)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """The wheel of the checkout, built through its sdist into a temporary folder."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)], cwd=REPO, timeout=300)
    (wheel,) = out.glob("deepinfer-*.whl")
    assert list(out.glob("deepinfer-*.tar.gz")), "no sdist was built"
    return wheel


def test_the_wheel_holds_every_data_file_and_module_of_the_package(built):
    names = set(zipfile.ZipFile(built).namelist())
    expected = _data_files()
    kinds = {Path(name).suffix for name in expected}
    assert {".cpp", ".html", ".js", ".css", ".mjs"} <= kinds, expected  # the globs still find the files
    modules = [p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    assert [name for name in [*expected, *modules] if name not in names] == []


@pytest.mark.real_model
def test_the_installed_wheel_answers_from_outside_the_checkout(built, tmp_path_factory):
    wheel = built
    root = tmp_path_factory.mktemp("wheel-venv")
    assert REPO not in root.parents, f"the temporary venv {root} must lie outside the repository"
    venv.EnvBuilder(with_pip=False).create(root / "venv")
    python, site = root / "venv" / "bin" / "python", _venv_site_packages(root / "venv")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], cwd=root, timeout=120)
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "checkout-dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(deps)))
    installed = site / "deepinfer"
    before = _snapshot(installed)
    _set_writable(installed, False)  # site-packages read-only (binding where the tests do not run as root)
    try:
        probe = _run([str(python), "-c", PROBE], cwd=root, timeout=300).splitlines()
        answer = _run([str(root / "venv" / "bin" / "deepinfer"), "generate", "--model", "smollm2-135m",
                       "--max-tokens", "8", "What is the capital of France?"], cwd=root, timeout=300)
    finally:
        _set_writable(installed, True)
    assert Path(probe[0]) == installed / "__init__.py"
    from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_status

    assert probe[1] == kernel_status(), "the installed wheel's CPU kernels differ from the checkout's"
    assert answer.strip(), "deepinfer generate printed no answer"
    assert _snapshot(installed) == before, "running the installed package wrote into site-packages"
