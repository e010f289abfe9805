"""Layering rules: dependencies between the layers of `deepinfer` point one way.

Every `.py` file under `deepinfer/` is parsed with `ast` (nothing is imported) and every import is
collected, at module level and inside functions, classes and `if TYPE_CHECKING:` blocks. Imports made
by `deepinfer/__init__.py` are ignored: it re-exports the public API.

Rules:
1. `engine/` imports neither `torch` nor `deepinfer.worker`, `.spec_decode`, `.model_executor`,
   `.entrypoints`, `.llm`, `.compose` (the composition of the system, `build_engine`).
1b. `serving/` (the request lifecycle below HTTP) imports none of `deepinfer.entrypoints`, `.llm`, `.compose`,
   nor an HTTP framework (`fastapi`, `starlette`, `uvicorn`) or `torch`.
2. `worker/` imports none of `deepinfer.engine`, `.entrypoints`, `.llm`, `.compose`; `spec_decode/` (between the
   worker and the model executor) imports, of ours, only `deepinfer.config`, `.contracts`,
   `.sampling_params`, `.model_executor` and itself (so neither the worker nor anything above it).
2b. Every drafter lives in `spec_decode/`: no class elsewhere implements the `Drafter` protocol
   (`propose` and `draft_probs`), and none elsewhere subclasses `ChainDrafter` (the one chain loop).
3. `model_executor/` imports none of `deepinfer.engine`, `.worker`, `.spec_decode`, `.entrypoints`, `.llm`,
   `.compose`.
4. `model_executor/layers/ops/` imports none of `deepinfer.model_executor.models`, `.loader`,
   `.layers.attention`, `.layers.sampler` and its stages (`.layers.penalties`, `.layers.token_draws`), nor a
   `sampling_metadata` module.
5a. `distributed/` (rank state and collectives, used by the parallel layers and the executor) imports,
   of ours, only `deepinfer.config`, `.environ`, `.contracts` and itself.
5. `contracts/` imports, of ours, only `deepinfer.config`, `.environ`, `.sampling_params` and other
   `deepinfer.contracts.*`; and no `torch`.
6. No import cycles among `deepinfer` modules (function-level imports count; importing a package is an
   edge to its `__init__.py` only). Inside `model_executor/`, a sub-package of `layers/` or `models/`
   (`layers/attention/`, `layers/ops/`, `models/deepseek_v4/`, ...) counts as one unit besides: no
   cycle among those units and the other modules either (`kernel_set` -> `attention/` -> `kernel_set`
   is one, though no module imports itself back).
7. No `hasattr(x, "name")` / `getattr(x, "name", ...)` anywhere in `deepinfer/` where "name" is a member
   of a contracts Protocol (`CachedModel`, `StepRunner`, ...) or a field of `ModelCapabilities`: what
   differs between implementations is declared, not probed (`tests/protocol_probes.py`).

Besides the static rules, `deepinfer.engine` and `deepinfer.contracts` must import with torch blocked.
The checker is `collect_imports`, `violations` and `cycles`; the synthetic-tree tests below show that
each rule can fail, using the same functions as the real-tree tests.
"""

import ast
import subprocess
import sys
import textwrap
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest
from protocol_probes import declared_members, probes

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "deepinfer"


@dataclass(frozen=True)
class Import:
    """One imported module: `importer` (module name) imports `target` at `path:line`."""

    path: str
    line: int
    importer: str
    target: str

    def __str__(self):
        return f"{self.path}:{self.line} imports {self.target}"


@dataclass(frozen=True)
class Rule:
    """Modules under `scope` must not import `forbidden` (prefixes), except `allowed` (prefixes)."""

    name: str
    scope: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cycle:
    """A strongly connected component (`members`): one concrete cycle through it (`edges`) and the other
    imports between its members (`others`), so that the report shows every import that ties it together."""

    members: tuple[str, ...]
    edges: tuple[Import, ...]
    others: tuple[Import, ...] = ()

    def __str__(self):
        path = " -> ".join([e.importer for e in self.edges] + [self.edges[0].importer])
        text = f"cycle {path}" + "".join(f"\n    {e}" for e in self.edges)
        if self.others:
            text += f"\n  other imports inside this component of {len(self.members)} modules:"
            text += "".join(f"\n    {e}" for e in self.others)
        return text


_ME = "deepinfer.model_executor"
RULES = (
    Rule("engine", "deepinfer.engine",
         ("torch", "deepinfer.worker", "deepinfer.spec_decode", _ME, "deepinfer.entrypoints", "deepinfer.llm",
          "deepinfer.compose")),
    Rule("serving", "deepinfer.serving",
         ("deepinfer.entrypoints", "deepinfer.llm", "deepinfer.compose", "fastapi", "starlette", "uvicorn", "torch")),
    Rule("worker", "deepinfer.worker", ("deepinfer.engine", "deepinfer.entrypoints", "deepinfer.llm",
                                        "deepinfer.compose")),
    Rule("spec_decode", "deepinfer.spec_decode", (PACKAGE,),
         ("deepinfer.config", "deepinfer.contracts", "deepinfer.sampling_params", _ME, "deepinfer.spec_decode")),
    Rule("model_executor", _ME,
         ("deepinfer.engine", "deepinfer.worker", "deepinfer.spec_decode", "deepinfer.entrypoints", "deepinfer.llm",
          "deepinfer.compose")),
    Rule(
        "ops",
        f"{_ME}.layers.ops",
        (
            f"{_ME}.models",
            f"{_ME}.loader",
            f"{_ME}.layers.attention",
            f"{_ME}.layers.sampler",
            f"{_ME}.layers.penalties",
            f"{_ME}.layers.token_draws",
            f"{_ME}.sampling_metadata",
            f"{_ME}.layers.sampling_metadata",
        ),
    ),
    Rule(
        "distributed",
        "deepinfer.distributed",
        (PACKAGE,),
        ("deepinfer.config", "deepinfer.environ", "deepinfer.contracts", "deepinfer.distributed"),
    ),
    Rule(
        "contracts",
        "deepinfer.contracts",
        ("torch", PACKAGE),
        ("deepinfer.config", "deepinfer.environ", "deepinfer.sampling_params", "deepinfer.contracts"),
    ),
)


# ---------------------------------------------------------------- the checker


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(root: Path, name: str) -> bool:
    """`name` is a module or (regular or namespace) package of ours under `root`."""
    base = root.joinpath(*name.split("."))
    return _within(name, PACKAGE) and (base.with_suffix(".py").is_file() or base.is_dir())


def _base_of_from(node: ast.ImportFrom, module: str, is_init: bool) -> str | None:
    """The absolute module of `from <base> import ...`; None when a relative import leaves the tree."""
    if node.level == 0:
        return node.module
    package = module.split(".") if is_init else module.split(".")[:-1]
    if node.level - 1 >= len(package):
        return None
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _targets(node: ast.AST, root: Path, module: str, is_init: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = _base_of_from(node, module, is_init)
    if base is None:
        return []
    submodules = [f"{base}.{a.name}" for a in node.names if a.name != "*" and _is_module(root, f"{base}.{a.name}")]
    return [base, *submodules]


def _file_imports(root: Path, path: Path) -> list[Import]:
    rel = path.relative_to(root)
    module, is_init = _module_name(rel), path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [
        Import(rel.as_posix(), node.lineno, module, target)
        for node in ast.walk(tree)
        for target in _targets(node, root, module, is_init)
    ]


def collect_imports(root: Path) -> list[Import]:
    """Every import of every `.py` file under `root/deepinfer`, except those of `deepinfer/__init__.py`."""
    files = sorted((root / PACKAGE).rglob("*.py"))
    imports = [imp for path in files if path != root / PACKAGE / "__init__.py" for imp in _file_imports(root, path)]
    return sorted(imports, key=lambda i: (i.path, i.line, i.target))


def _breaks(imp: Import, rule: Rule) -> bool:
    if not _within(imp.importer, rule.scope):
        return False
    forbidden = any(_within(imp.target, p) for p in rule.forbidden)
    return forbidden and not any(_within(imp.target, p) for p in rule.allowed)


def violations(imports: list[Import], rules: tuple[Rule, ...]) -> list[tuple[Rule, Import]]:
    """The imports that break a rule, each with the rule it breaks."""
    return [(rule, imp) for rule in rules for imp in imports if _breaks(imp, rule)]


def _graph(imports: list[Import]) -> dict[str, dict[str, Import]]:
    """module -> {imported module: first import}, over modules that are files in the tree."""
    nodes = {imp.importer for imp in imports}
    graph: dict[str, dict[str, Import]] = {n: {} for n in nodes}
    for imp in imports:
        if imp.target in nodes and imp.target != imp.importer:
            graph[imp.importer].setdefault(imp.target, imp)
    return graph


def _components(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _shortest_cycle(graph: dict[str, dict[str, Import]], members: list[str]) -> tuple[Import, ...]:
    """A shortest cycle through `members[0]`, staying inside the component (breadth-first search)."""
    start, inside = members[0], set(members)
    came_from: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child, imp in sorted(graph[node].items()):
            if child == start:
                edges = [imp]
                while edges[0].importer != start:
                    edges.insert(0, came_from[edges[0].importer])
                return tuple(edges)
            if child in inside and child not in came_from:
                came_from[child] = imp
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")


def _cycle(graph: dict[str, dict[str, Import]], members: list[str]) -> Cycle:
    edges = _shortest_cycle(graph, members)
    inside = [imp for m in members for t, imp in sorted(graph[m].items()) if t in members and imp not in edges]
    return Cycle(tuple(members), edges, tuple(inside))


def cycles(imports: list[Import]) -> list[Cycle]:
    """One entry per import cycle (component of more than one module) among our modules."""
    graph = _graph(imports)
    return [_cycle(graph, c) for c in sorted(c for c in _components(graph) if len(c) > 1)]


UNIT_PARENTS = (f"{_ME}.layers", f"{_ME}.models")  # their sub-packages count as one unit each


def _unit(module: str) -> str:
    """`module`, or the sub-package of a `UNIT_PARENTS` package that holds it."""
    for parent in UNIT_PARENTS:
        if module.startswith(parent + "."):
            return f"{parent}.{module[len(parent) + 1:].split('.')[0]}"
    return module


def unit_cycles(imports: list[Import]) -> list[Cycle]:
    """Import cycles inside `model_executor/` once each sub-package of `layers/` and `models/` is one
    unit: a module that imports a sub-package that imports the module back, by any files."""
    inside = [imp for imp in imports if _within(imp.importer, _ME) and _within(imp.target, _ME)]
    return cycles([Import(imp.path, imp.line, _unit(imp.importer), _unit(imp.target)) for imp in inside])


@dataclass(frozen=True)
class DrafterClass:
    """A class at `path:line` that drafts: it implements `propose` and `draft_probs`, or subclasses
    `ChainDrafter`."""

    path: str
    line: int
    name: str

    def __str__(self):
        return f"{self.path}:{self.line} class {self.name} drafts outside deepinfer/spec_decode/"


def drafters_outside_spec_decode(root: Path) -> list[DrafterClass]:
    """Every drafter class (`DrafterClass`) outside `deepinfer/spec_decode/`; Protocols excepted."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(f"{PACKAGE}/spec_decode/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).split(".")[-1] for b in node.bases}
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            if "Protocol" not in bases and ({"propose", "draft_probs"} <= methods or "ChainDrafter" in bases):
                found.append(DrafterClass(rel, node.lineno, node.name))
    return found


def _fail_if_any(found: list, title: str) -> None:
    if found:
        pytest.fail(f"{title}:\n" + "\n".join(str(item) for item in found), pytrace=False)


# ---------------------------------------------------------------- the real tree


@pytest.fixture(scope="module")
def real_imports() -> list[Import]:
    return collect_imports(REPO_ROOT)


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_layer_rule(real_imports, rule):
    found = [imp for _, imp in violations(real_imports, (rule,))]
    _fail_if_any(found, f"layer rule {rule.name!r} broken by {len(found)} import(s)")


def test_no_import_cycles(real_imports):
    _fail_if_any(cycles(real_imports), "import cycles among deepinfer modules")


def test_no_cycles_among_the_model_executors_units(real_imports):
    _fail_if_any(unit_cycles(real_imports), "import cycles among model_executor's modules and sub-packages")


def test_every_drafter_lives_in_spec_decode():
    _fail_if_any(drafters_outside_spec_decode(REPO_ROOT), "drafters outside spec_decode/")


def test_collector_sees_the_real_tree(real_imports):
    """Guards the guards: the real-tree checks are not vacuous."""
    by_file = {imp.path for imp in real_imports}
    assert "deepinfer/engine/scheduler.py" in by_file
    assert not any(imp.path == "deepinfer/__init__.py" for imp in real_imports)
    assert any(_within(imp.importer, "deepinfer.model_executor") and imp.target == "torch" for imp in real_imports)


@pytest.mark.subprocess
def test_engine_and_contracts_import_without_torch():
    """Every module of `deepinfer.engine` and `deepinfer.contracts` loads with torch blocked."""
    code = textwrap.dedent("""
        import importlib, pkgutil, sys
        sys.modules["torch"] = None

        def fail(name):
            raise ImportError(f"cannot import package {name}")

        for package_name in ("deepinfer.engine", "deepinfer.contracts"):
            package = importlib.import_module(package_name)
            for info in pkgutil.walk_packages(package.__path__, package_name + ".", onerror=fail):
                importlib.import_module(info.name)
                print(info.name)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert "deepinfer.engine.scheduler" in result.stdout.split()


# ---------------------------------------------------------------- synthetic trees: each rule can fail


SYNTHETIC = {
    "__init__.py": "from deepinfer.llm import LLM\nimport torch\n",
    "config.py": "",
    "llm.py": "",
    "engine/__init__.py": "",
    "engine/bad.py": "def f():\n    import torch\n    from deepinfer.worker import model_runner\n",
    "engine/request.py": "",
    "engine/good.py": (
        "from typing import TYPE_CHECKING\n"
        "from deepinfer.config import Config\n"
        "from deepinfer.contracts.c import X\n"
        "from . import request\n"
        "if TYPE_CHECKING:\n"
        "    import torch.nn\n"
    ),
    "worker/__init__.py": "",
    "worker/model_runner.py": "class R:\n    def f(self):\n        from ..engine.request import Request\n",
    "model_executor/__init__.py": "",
    "model_executor/runner.py": "import deepinfer.worker.model_runner as mr\n",
    "model_executor/models/__init__.py": "",
    "model_executor/models/llama.py": "",
    "model_executor/layers/__init__.py": "",
    "model_executor/layers/ops/__init__.py": "",
    "model_executor/layers/ops/x.py": "import math\n\nimport deepinfer.model_executor.models.llama\n",
    "model_executor/layers/ops/y.py": "from ...models import llama\nfrom .x import helper\n",
    "contracts/c.py": (
        "from deepinfer.config import Config\nfrom deepinfer.engine.request import Request\nimport torch\n"
    ),
    "a.py": "def f():\n    from deepinfer import b\n",
    "b.py": "def g():\n    import deepinfer.a\n",
}


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def synthetic(tmp_path) -> list[Import]:
    _write_tree(tmp_path, SYNTHETIC)
    return collect_imports(tmp_path)


def _broken(imports: list[Import], name: str) -> list[str]:
    rule = next(r for r in RULES if r.name == name)
    return [str(imp) for _, imp in violations(imports, (rule,))]


def test_collect_resolves_imports(synthetic):
    found = {str(imp) for imp in synthetic}
    assert "deepinfer/engine/good.py:4 imports deepinfer.engine.request" in found  # from . import <submodule>
    assert "deepinfer/engine/good.py:4 imports deepinfer.engine" in found
    assert "deepinfer/engine/good.py:6 imports torch.nn" in found  # inside `if TYPE_CHECKING:`
    assert "deepinfer/engine/good.py:2 imports deepinfer.config" in found
    assert "deepinfer/engine/good.py:2 imports deepinfer.config.Config" not in found  # a name, not a module
    assert "deepinfer/worker/model_runner.py:3 imports deepinfer.engine.request" in found  # `..` in a method
    assert "deepinfer/model_executor/layers/ops/y.py:1 imports deepinfer.model_executor.models.llama" in found
    assert "deepinfer/model_executor/layers/ops/y.py:2 imports deepinfer.model_executor.layers.ops.x" in found
    assert not any(imp.path == "deepinfer/__init__.py" for imp in synthetic)


def test_engine_rule_can_fail(synthetic):
    assert _broken(synthetic, "engine") == [
        "deepinfer/engine/bad.py:2 imports torch",
        "deepinfer/engine/bad.py:3 imports deepinfer.worker",
        "deepinfer/engine/bad.py:3 imports deepinfer.worker.model_runner",
        "deepinfer/engine/good.py:6 imports torch.nn",
    ]


def test_worker_rule_can_fail(synthetic):
    assert _broken(synthetic, "worker") == ["deepinfer/worker/model_runner.py:3 imports deepinfer.engine.request"]


def test_model_executor_rule_can_fail(synthetic):
    assert _broken(synthetic, "model_executor") == [
        "deepinfer/model_executor/runner.py:1 imports deepinfer.worker.model_runner",
    ]


def test_spec_decode_rule_can_fail(tmp_path):
    files = {
        "spec_decode/__init__.py": "",
        "spec_decode/good.py": ("from deepinfer.config import SpeculativeConfig\n"
                                "from deepinfer.contracts.plan import P\n"
                                "from deepinfer.model_executor.forward_context import forward_context\n"),
        "spec_decode/bad.py": "from deepinfer.worker.input_batch import build\nimport deepinfer.structured_output\n",
    }
    _write_tree(tmp_path, files)
    assert _broken(collect_imports(tmp_path), "spec_decode") == [
        "deepinfer/spec_decode/bad.py:1 imports deepinfer.worker.input_batch",
        "deepinfer/spec_decode/bad.py:2 imports deepinfer.structured_output",
    ]


def test_drafter_rule_can_fail(tmp_path):
    files = {
        "spec_decode/mtp.py": "class MtpDrafter(ChainDrafter):\n    pass\n",
        "contracts/drafting.py": ("class Drafter(Protocol):\n    def propose(self): ...\n"
                                  "    def draft_probs(self): ...\n"),
        "worker/drafters.py": ("class NgramDrafter:\n    def propose(self): ...\n    def draft_probs(self): ...\n\n"
                               "class Proposer:\n    def propose(self): ...\n"),
        "worker/mtp.py": "from deepinfer.spec_decode import chain\n\nclass Mine(chain.ChainDrafter):\n    pass\n",
    }
    _write_tree(tmp_path, files)
    assert [str(d) for d in drafters_outside_spec_decode(tmp_path)] == [
        "deepinfer/worker/drafters.py:1 class NgramDrafter drafts outside deepinfer/spec_decode/",
        "deepinfer/worker/mtp.py:3 class Mine drafts outside deepinfer/spec_decode/",
    ]


def test_unit_cycle_rule_can_fail(tmp_path):
    """kernel_set imports attention/torch_ref, attention/backend imports kernel_set: no module cycle,
    a cycle of units; ops/ importing its own sub-package is none."""
    files = {
        "model_executor/layers/kernel_set.py": "from deepinfer.model_executor.layers.attention import torch_ref\n",
        "model_executor/layers/attention/__init__.py": "",
        "model_executor/layers/attention/torch_ref.py": "",
        "model_executor/layers/attention/backend.py": "from deepinfer.model_executor.layers import kernel_set\n",
        "model_executor/layers/ops/lora.py": "from deepinfer.model_executor.layers.ops.triton import lora\n",
        "model_executor/layers/ops/triton/lora.py": "from deepinfer.model_executor.layers.ops import lora_kernels\n",
        "model_executor/layers/ops/lora_kernels.py": "",
    }
    _write_tree(tmp_path, files)
    imports = collect_imports(tmp_path)
    assert cycles(imports) == []
    [found] = unit_cycles(imports)
    assert found.members == ("deepinfer.model_executor.layers.attention", "deepinfer.model_executor.layers.kernel_set")
    assert [str(e) for e in found.edges] == [
        "deepinfer/model_executor/layers/attention/backend.py:1 imports deepinfer.model_executor.layers.kernel_set",
        "deepinfer/model_executor/layers/kernel_set.py:1 imports deepinfer.model_executor.layers.attention",
    ]


def test_ops_rule_can_fail(synthetic):
    assert _broken(synthetic, "ops") == [
        "deepinfer/model_executor/layers/ops/x.py:3 imports deepinfer.model_executor.models.llama",
        "deepinfer/model_executor/layers/ops/y.py:1 imports deepinfer.model_executor.models",
        "deepinfer/model_executor/layers/ops/y.py:1 imports deepinfer.model_executor.models.llama",
    ]


def test_contracts_rule_can_fail(synthetic):
    assert _broken(synthetic, "contracts") == [
        "deepinfer/contracts/c.py:2 imports deepinfer.engine.request",
        "deepinfer/contracts/c.py:3 imports torch",
    ]


def test_cycle_check_can_fail(synthetic):
    found = cycles(synthetic)
    assert [c.members for c in found] == [("deepinfer.a", "deepinfer.b")]
    assert [str(e) for e in found[0].edges] == [
        "deepinfer/a.py:2 imports deepinfer.b",
        "deepinfer/b.py:2 imports deepinfer.a",
    ]
    assert str(found[0]).startswith("cycle deepinfer.a -> deepinfer.b -> deepinfer.a\n    deepinfer/a.py:2")


def test_cycle_check_finds_long_cycles_and_ignores_packages_imported_by_submodules(tmp_path):
    files = {
        "p/__init__.py": "",
        "p/m.py": "from deepinfer.p import n\n",  # edge to p/__init__.py and p/n.py; __init__ imports nothing
        "p/n.py": "",
        "x.py": "import deepinfer.y\n",
        "y.py": "import deepinfer.z\n",
        "z.py": "def f():\n    from . import x\n",
    }
    _write_tree(tmp_path, files)
    found = cycles(collect_imports(tmp_path))
    assert [c.members for c in found] == [("deepinfer.x", "deepinfer.y", "deepinfer.z")]
    assert [str(e) for e in found[0].edges] == [
        "deepinfer/x.py:1 imports deepinfer.y",
        "deepinfer/y.py:1 imports deepinfer.z",
        "deepinfer/z.py:2 imports deepinfer.x",
    ]


def test_cycle_report_lists_every_import_inside_a_component(tmp_path):
    files = {
        "x.py": "import deepinfer.y\n",
        "y.py": "import deepinfer.x\nimport deepinfer.z\n",
        "z.py": "import deepinfer.x\n",
    }
    _write_tree(tmp_path, files)
    [found] = cycles(collect_imports(tmp_path))
    assert [str(e) for e in found.edges] == [
        "deepinfer/x.py:1 imports deepinfer.y",
        "deepinfer/y.py:1 imports deepinfer.x",
    ]
    assert [str(e) for e in found.others] == [
        "deepinfer/y.py:2 imports deepinfer.z",
        "deepinfer/z.py:1 imports deepinfer.x",
    ]
    assert "other imports inside this component of 3 modules:" in str(found)


# ---------------------------------------------------------------- rule 7: no probes of protocol members


def test_no_probes_of_protocol_members():
    _fail_if_any(probes(REPO_ROOT, declared_members(REPO_ROOT)), "hasattr / getattr on a declared member")


def test_declared_members_cover_the_seams():
    """Guards the guard: the protocols' and the capability record's names are all collected."""
    declared = declared_members(REPO_ROOT)
    assert {name: declared[name] for name in ("execute", "stats", "close", "num_blocks")} == dict.fromkeys(
        ("execute", "stats", "close", "num_blocks"), "StepRunner")
    assert declared["cache_groups"] == declared["capabilities"] == "CachedModel"
    assert declared["add_mtp"] == declared["last_streams"] == "DraftingModel"  # a subprotocol
    assert declared["graph_safe_decode"] == "ModelCapabilities"
    assert "BoundCaches" not in declared.values() and "group_index" not in declared  # a dataclass, not a protocol


PROBE_TREE = {
    "contracts/model.py": (
        "from dataclasses import dataclass\nfrom typing import Protocol\n\n"
        "@dataclass(frozen=True)\nclass ModelCapabilities:\n    graph_safe_decode: bool = False\n\n"
        "class Runner(Protocol):\n    num_blocks: int\n    def close(self) -> None: ...\n"
        "    def _private(self): ...\n\n"
        "class Plain:\n    def helper(self): ...\n"
    ),
    "engine/loop.py": (
        "def stop(runner, model, cfg, name):\n"
        "    close = getattr(runner, 'close', None)\n"  # flagged
        "    if hasattr(runner, 'num_blocks'):\n"  # flagged
        "        pass\n"
        "    safe = getattr(model, 'graph_safe_decode', False)\n"  # flagged: a capability field
        "    size = getattr(cfg, 'hidden_size', 0)\n"  # a config field: fine
        "    other = getattr(runner, name)\n"  # not a literal: fine
        "    return hasattr(runner, '_private') or getattr(runner, 'helper', None)\n"  # not declared: fine
    ),
}


def test_probe_rule_can_fail(tmp_path):
    _write_tree(tmp_path, PROBE_TREE)
    declared = declared_members(tmp_path)
    assert declared == {"graph_safe_decode": "ModelCapabilities", "num_blocks": "Runner", "close": "Runner"}
    assert [str(p) for p in probes(tmp_path, declared)] == [
        "deepinfer/engine/loop.py:2 getattr(..., 'close') probes a member the contracts declare",
        "deepinfer/engine/loop.py:3 hasattr(..., 'num_blocks') probes a member the contracts declare",
        "deepinfer/engine/loop.py:5 getattr(..., 'graph_safe_decode') probes a member the contracts declare",
    ]
