"""docs/book_map.md maps the book's chapter 3 to this code; every reference in it must resolve.

The map's tables have a "DeepInfer" column whose backticked spans are references:
`path/file.py:name`, `path/file.py:Class.method` or a bare `path`, relative to the repository
root. Names are found with `ast` (top-level defs, classes, assignments; a class's methods and
class attributes), so no module is imported. Every "Listing 3.N" and every lab that the chapter's
text runs must have a row; the chapter is read from `<repo>/../shared/seeds/` when present.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "book_map.md"
CHAPTER = ROOT.parent / "shared" / "seeds" / "000_2fdda3eedab2d4ed.txt"
COLUMN = "DeepInfer"
BOOK_COLUMN = "Book item"
REFERENCE = re.compile(r"^(?P<path>[\w./-]+\.[a-z]+)(?::(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?))?$")
LISTING = re.compile(r"Listing 3\.(\d+)(?!\d)")
LAB_RUN = re.compile(r"python3? (labs/\w+\.py)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def map_rows(text: str) -> list[dict[str, str]]:
    """Every data row of every table, as {header: cell}."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
        elif not all(set(c) <= set("-: ") for c in cells):
            assert len(cells) == len(header), f"row has {len(cells)} cells, header {len(header)}: {line}"
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


def references(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@functools.cache
def symbols(path: Path) -> frozenset[str]:
    """Names defined at the top of a module, and `Class.member` for its classes' members."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body:
        for name in _defined(node):
            names.add(name)
        if isinstance(node, ast.ClassDef):
            names.update(f"{node.name}.{member}" for child in node.body for member in _defined(child))
    return frozenset(names)


def _defined(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def check_reference(ref: str, root: Path = ROOT) -> str | None:
    """None when `ref` resolves under `root`, else why not."""
    match = REFERENCE.match(ref)
    if match is None:
        return f"`{ref}` is not of the form path/file.py[:name or Class.method]"
    path = root / match["path"]
    if not path.is_file():
        return f"`{ref}`: no file {match['path']}"
    name = match["name"]
    if name is None:
        return None
    if path.suffix != ".py":
        return f"`{ref}`: only a .py file can name a function or class"
    if name not in symbols(path):
        return f"`{ref}`: {match['path']} defines no {name}"
    return None


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    rows = map_rows(MAP.read_text())
    assert rows, "docs/book_map.md has no table rows"
    return rows


def test_every_table_has_the_deepinfer_column(rows):
    assert all(COLUMN in row and BOOK_COLUMN in row for row in rows)


def test_every_reference_resolves(rows):
    refs = [ref for row in rows for ref in references(row[COLUMN])]
    assert len(refs) > 100  # the map is not accidentally empty
    problems = [p for p in map(check_reference, refs) if p]
    assert not problems, "\n".join(problems)


def test_the_deepinfer_column_holds_references_only(rows):
    """At least one reference per row, and nothing but references (prose goes in the difference
    column), so no reference can hide outside backticks."""
    bare = [row[BOOK_COLUMN] for row in rows if not references(row[COLUMN])]
    assert not bare, f"rows without a DeepInfer reference: {bare}"
    prose = [row[COLUMN] for row in rows if re.sub(r"`[^`]+`", "", row[COLUMN]).strip(" ,")]
    assert not prose, f"text outside references in the DeepInfer column: {prose}"


def test_a_renamed_function_or_method_is_caught():
    assert check_reference("deepinfer/environ.py:read_environ") is None
    assert check_reference("deepinfer/worker/cache_engine.py:CacheEngine.layer_view") is None
    assert check_reference("deepinfer/model_executor/layers/ops/cache_common.py:V41_FORMAT") is None
    assert "defines no read_environs" in check_reference("deepinfer/environ.py:read_environs")
    assert "defines no CacheEngine.layer_views" in check_reference(
        "deepinfer/worker/cache_engine.py:CacheEngine.layer_views")
    assert "no file" in check_reference("deepinfer/no_such_module.py:anything")
    assert "not of the form" in check_reference("read_environ()")


def _chapter_text() -> str:
    if not CHAPTER.is_file():
        pytest.skip(f"the book's chapter 3 text is not beside this checkout ({CHAPTER}); "
                    "the listing and lab coverage check needs it")
    return CHAPTER.read_text(encoding="utf-8")


def test_every_listing_of_the_chapter_has_a_row(rows):
    listed = {int(n) for n in LISTING.findall(_chapter_text())}
    assert listed, "no 'Listing 3.N' found in the chapter text"
    mapped = {int(n) for row in rows for n in LISTING.findall(row[BOOK_COLUMN]) if references(row[COLUMN])}
    missing = sorted(listed - mapped)
    assert not missing, f"listings without a row in docs/book_map.md: {[f'3.{n}' for n in missing]}"


def test_every_lab_the_chapter_runs_has_a_row(rows):
    labs = set(LAB_RUN.findall(_chapter_text()))
    assert labs, "no lab command found in the chapter text"
    mapped = {REFERENCE.match(ref)["path"] for row in rows for ref in references(row[COLUMN])
              if REFERENCE.match(ref)}
    assert labs <= mapped, f"labs without a row: {sorted(labs - mapped)}"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    following = re.search(r"^## ", text[start + len(heading):], re.MULTILINE)
    return text[start:start + len(heading) + following.start()] if following else text[start:]


def test_the_map_is_linked_from_the_readme_and_the_architecture_page():
    readme = (ROOT / "README.md").read_text()
    assert "docs/book_map.md" in _section(readme, "## How it works, for readers of the book")
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    top = architecture.split("\n## ", 1)[0]  # before the first section
    assert "book_map.md" in top
