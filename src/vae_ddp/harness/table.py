"""Markdown tables for the terminal and for the documentation pages.

Each study prints its tables and also writes exactly that Markdown to ``OUT/tables.md``
([`write_tables`][vae_ddp.harness.table.write_tables]); the docs build includes that file,
so a page shows what the command printed without parsing its output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["format_table", "write_tables", "number", "TABLES"]

#: The file every study writes into its output folder: its tables, titles and verdicts.
TABLES = "tables.md"


def number(v: Optional[float], digits: int = 3, none: str = "-", sci_below: Optional[float] = None,
           zeros: bool = False) -> str:
    """The one way the studies write a number in prose and verdicts: ``digits`` significant
    digits (Python's ``g`` format: ``0.109``, ``12.5``, ``3e-05``); ``zeros`` keeps trailing zeros
    (``1.00``, ``0.100``); below ``sci_below`` (absolute, zero excepted) always scientific with
    ``digits`` digits (``2.50e-04``); ``none`` for None."""
    if v is None:
        return none
    if sci_below is not None and v != 0 and abs(v) < sci_below:
        return f"{v:.{digits - 1}e}"
    return f"{v:#.{digits}g}".rstrip(".") if zeros else f"{v:.{digits}g}"


def _fmt(v: Any) -> str:
    """A table cell: a float with 4 decimals, or 4 significant digits in scientific notation
    outside [1e-3, 1e4); None as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3e}" if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e4) else f"{v:.4f}"
    return str(v)


def _cell(text: str) -> str:
    """A pipe inside a cell is content, not a column boundary."""
    return text.replace("|", "\\|").replace("\n", " ")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A Markdown pipe table (readable as plain text too), numbers formatted compactly.

    ``title`` (optional) is a line above the table, separated by a blank line. A ``|`` inside
    a header or cell is escaped (``\\|``) so the table keeps its columns.
    """
    head = [_cell(str(h)) for h in headers]
    cells = [[_cell(_fmt(v)) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = ([title, ""] if title else []) + [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join(out + [line(r) for r in cells])


def write_tables(out_dir: Path | str, markdown: str) -> Path:
    """Write ``markdown`` (what the study printed: titles, tables, verdict lines) to
    ``out_dir/tables.md``, creating ``out_dir`` if needed; return the file's path."""
    path = Path(out_dir) / TABLES
    path.parent.mkdir(parents=True, exist_ok=True)
    from vae_ddp.outputs import write_atomic

    return write_atomic(path, markdown.rstrip("\n") + "\n")
