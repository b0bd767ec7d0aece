"""How much of each module notebook shows its code working: example lines per exported line.

The measure, per notebook in nbs/ that exports a module (`#| default_exp`): the non-blank lines of its code cells
that carry `#| export` or `#| exports` are *exported lines*; the non-blank lines of every other code cell are
*example lines*, except the set-up every notebook has (the Colab install cell and the `#| default_exp` cell).
`#|` directive lines count on neither side. density = example lines / exported lines. fastcore's `01_basics` is
about 0.9 and `03_loss` is grpo-lab's model; STYLE.md asks for 0.6 or more.

    python tests/notebook_density.py              # the table for every module notebook
    python tests/notebook_density.py 06_trainer   # only the notebooks whose name contains one of the words
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALL = '"google.colab" in sys.modules'


def _lines(source: str) -> int:
    "Non-blank lines that are not `#|` directives."
    return sum(1 for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#|"))


def _directives(source: str) -> set[str]:
    return {line.lstrip()[2:].split()[0] for line in source.splitlines() if line.lstrip().startswith("#|")
            and line.lstrip()[2:].split()}


def density(path: Path) -> tuple[int, int] | None:
    "(exported lines, example lines) of a module notebook; None for a notebook that exports no module."
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    if not any("default_exp" in _directives(s) for s in code):
        return None
    exported = examples = 0
    for source in code:
        marks = _directives(source)
        if marks & {"export", "exports"}:
            exported += _lines(source)
        elif "default_exp" not in marks and INSTALL not in source:
            examples += _lines(source)
    return exported, examples


def table(words: list[str] | None = None) -> list[tuple[str, int, int, float]]:
    "One row per module notebook: name, exported lines, example lines, density."
    rows = []
    for path in sorted((ROOT / "nbs").glob("*.ipynb")):
        counted = density(path)
        if counted and (not words or any(w in path.stem for w in words)):
            exported, examples = counted
            rows.append((path.stem, exported, examples, examples / exported if exported else float("inf")))
    return rows


if __name__ == "__main__":
    print(f"{'notebook':<14} {'exported':>8} {'examples':>8} {'density':>7}")
    for name, exported, examples, d in table(sys.argv[1:]):
        print(f"{name:<14} {exported:>8} {examples:>8} {d:>7.2f}{'' if d >= 0.6 else '   < 0.6'}")
