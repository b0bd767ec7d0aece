"""tools/student_copy.py: the student copy keeps every cell and puts each exercise's solution after an appendix heading."""
import json
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from student_copy import is_solution, student_notebook  # noqa: E402

TUTORIALS = sorted((ROOT / "nbs" / "tutorials").glob("[0-9]*.ipynb"))


def test_every_solution_moves_after_the_appendix_heading(tmp_path):
    "Each tutorial's solutions (markdown + code) come after 'Appendix: solutions'; no cell is lost or duplicated."
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "student_copy.py"), str(tmp_path)], capture_output=True,
                       text=True, check=True)
    assert len(r.stdout.splitlines()) == len(TUTORIALS)
    for path in TUTORIALS:
        course = json.loads(path.read_text())
        student = json.loads((tmp_path / path.name).read_text())
        sources = ["".join(c["source"]) for c in student["cells"]]
        assert sorted(sources) == sorted(["".join(c["source"]) for c in course["cells"]] +
                                         [s for s in sources if s.startswith("## Appendix: solutions")])
        solutions = [i for i, c in enumerate(student["cells"]) if is_solution(c)]
        if solutions:
            appendix = sources.index(next(s for s in sources if s.startswith("## Appendix: solutions")))
            assert min(solutions) > appendix, path.name
            assert all(not c.get("outputs") for c in student["cells"][appendix:] if c["cell_type"] == "code")


def test_a_solution_and_its_code_move_together():
    "The code cells after a solution go with it; the next markdown cell ends it."
    cell = lambda kind, text: {"cell_type": kind, "source": [text], **({"outputs": [1]} if kind == "code" else {})}
    nb = {"cells": [cell("markdown", "## Exercises\n1. Do it."), cell("markdown", "<details><summary>Solution 1</summary>x"),
                    cell("code", "answer = 1"), cell("markdown", "## What you now know"), cell("code", "summary")]}
    out = [("".join(c["source"]), c.get("outputs")) for c in student_notebook(nb)["cells"]]
    assert [s for s, _ in out] == ["## Exercises\n1. Do it.", "## What you now know", "summary", out[3][0],
                                   "<details><summary>Solution 1</summary>x", "answer = 1"]
    assert out[-1][1] == [] and out[2][1] == [1]
