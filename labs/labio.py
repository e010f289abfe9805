"""Printing and saving the labs' output blocks (shared by the lab scripts beside it)."""

from __future__ import annotations

from pathlib import Path


def shown(path: Path) -> Path:
    """`path` relative to the working directory when it lies below it."""
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def emit(blocks: list[list[str]], out: Path) -> str:
    """Print the blocks (a blank line between them), save them to `out`, and say where."""
    text = "\n\n".join("\n".join(lines) for lines in blocks) + "\n"
    print(text, end="")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"Saved output · {shown(out)}")
    return text
