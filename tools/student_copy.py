"""Build a student copy of the course: every tutorial with its exercise solutions moved to an appendix at its end.

In the course each exercise's solution follows the exercises at once (a `<details><summary>Solution N</summary>`
markdown cell, then the code cell(s) that run it, which the tests execute). A workshop hands out a copy where a
learner meets the exercises first and finds the solutions only by scrolling past an "Appendix: solutions" heading;
the self-check answers (folded `<details>` of "Check yourself") stay where they are. Outputs of the moved cells are
cleared, so a printed answer does not give a solution away either.

    python tools/student_copy.py OUT_DIR                  # every tutorial in nbs/tutorials
    python tools/student_copy.py OUT_DIR nbs/tutorials/01_first_grpo_run.ipynb
"""
import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = re.compile(r"^\s*<details>\s*<summary>\s*Solutions?\b", re.I)
APPENDIX = ("## Appendix: solutions\n\nTry the exercises first. Each solution below is the one the course runs and "
            "tests; its code cells run as they are once the cells above them have run.")


def is_solution(cell: dict) -> bool:
    return cell["cell_type"] == "markdown" and bool(SOLUTION.match("".join(cell["source"])))


def student_notebook(nb: dict) -> dict:
    "`nb` with each solution (its markdown cell and the code cells after it) moved, in order, to an appendix."
    kept, moved, in_solution = [], [], False
    for cell in nb["cells"]:
        if is_solution(cell):
            in_solution = True
        elif cell["cell_type"] == "markdown":
            in_solution = False
        if in_solution:
            cell = {**cell, "outputs": [], "execution_count": None} if cell["cell_type"] == "code" else cell
            moved.append(cell)
        else:
            kept.append(cell)
    if moved:
        kept += [{"cell_type": "markdown", "metadata": {}, "source": [APPENDIX]}, *moved]
    return {**nb, "cells": kept}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("notebooks", nargs="*", type=Path)
    a = parser.parse_args(argv)
    paths = a.notebooks or sorted((ROOT / "nbs" / "tutorials").glob("[0-9]*.ipynb"))
    a.out_dir.mkdir(parents=True, exist_ok=True)
    for path in paths:
        nb = json.loads(path.read_text())
        student = student_notebook(nb)
        n = sum(is_solution(c) for c in nb["cells"])
        (a.out_dir / path.name).write_text(json.dumps(student, indent=1, ensure_ascii=False) + "\n")
        print(f"{path.name}: {n} solutions moved to the appendix")


if __name__ == "__main__":
    main()
