"""The probe rule of `tests/test_layering.py`: no `hasattr` / `getattr` on a protocol's member.

A seam's protocol (`CachedModel`, `StepRunner`, ... in `deepinfer/contracts/`) says what its
objects offer; what differs between implementations is declared (`ModelCapabilities`) or is a
protocol method (`StepRunner.stats`, `close`). Probing for a member instead hides a missing one
behind a fallback. So `hasattr(x, "name")` and `getattr(x, "name"[, default])` fail the rule when
"name" is a member of a contracts Protocol, or a field of the capabilities record: the checker
cannot know x's type, and a name the contracts declare is not probed for on anything.

Both functions parse with `ast` (nothing is imported), like the import checker.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "deepinfer"
_PROBES = ("hasattr", "getattr")
RECORDS = ("ModelCapabilities",)  # declared records whose fields are read, never probed for


@dataclass(frozen=True)
class Probe:
    """`call(x, name, ...)` at `path:line`, where `name` is a declared member."""

    path: str
    line: int
    call: str
    name: str

    def __str__(self):
        return f"{self.path}:{self.line} {self.call}(..., {self.name!r}) probes a member the contracts declare"


def _is_protocol(node: ast.ClassDef, protocols: set[str]) -> bool:
    names = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases}
    return "Protocol" in names or bool(names & protocols)


def _members(node: ast.ClassDef) -> set[str]:
    """Public methods and annotated attributes of a class body."""
    found = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            found.add(item.target.id)
    return {name for name in found if not name.startswith("_")}


def declared_members(root: Path) -> dict[str, str]:
    """member name -> the contracts class declaring it: every Protocol class of
    `root/deepinfer/contracts/` (subprotocols included), and the fields of `RECORDS`."""
    declared: dict[str, str] = {}
    protocols: set[str] = set()
    for path in sorted((root / PACKAGE / "contracts").rglob("*.py")):
        classes = [n for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(n, ast.ClassDef)]
        for node in classes:  # in source order: a subprotocol follows its base
            if _is_protocol(node, protocols) or node.name in RECORDS:
                protocols.add(node.name)
                for name in _members(node):
                    declared.setdefault(name, node.name)
    return declared


def probes(root: Path, declared: dict[str, str]) -> list[Probe]:
    """Every `hasattr(x, "name")` / `getattr(x, "name", ...)` under `root/deepinfer` whose name
    (a string literal) is in `declared`."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _PROBES
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in declared):
                found.append(Probe(rel, node.lineno, node.func.id, node.args[1].value))
    return found
