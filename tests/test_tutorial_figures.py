"""A figure quoted in a tutorial's prose is a figure its stored outputs print.

The convention: in a markdown cell, a number a reader is meant to find in an output carries the marker `<!--out-->`
right after it (an HTML comment: invisible on GitHub, in Jupyter and on the docs site), e.g.
`the jitter grows 1.5x<!--out--> where 1/sqrt(n) predicts 2x`. The check finds each marked figure and looks for it in
the stored outputs of the code cells around it (NEAR code cells before and after the markdown cell), within the
rounding the prose used: `1.5` matches a printed 1.46 or 1.54, `21%` matches 0.208 or 20.8%, `1,977` matches 1977.
Prose that reads a figure from a computed value (an f-string printed by the cell) needs no marker.

    python tests/test_tutorial_figures.py nbs/tutorials/05_reward_curves.ipynb    # list each marked figure and where it is
"""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "nbs" / "tutorials").glob("[0-9]*.ipynb"))
MARKER = "<!--out-->"
NEAR = 3
QUOTED = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)\s*(%|x|GiB|s|points)?\s*" + re.escape(MARKER))
PRINTED = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def output_text(cell: dict) -> str:
    "Everything a code cell's stored outputs show as text."
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append("".join(out["text"]))
        elif "data" in out:
            parts.append("".join(out["data"].get("text/plain", "")))
    return "\n".join(parts)


def printed_numbers(text: str) -> list[float]:
    return [float(m.replace(",", "")) for m in PRINTED.findall(text) if m.replace(",", "").strip("-")]


def matches(quoted: str, unit: str | None, value: float) -> bool:
    "Does a printed `value` round to the `quoted` figure (as a percent too, when the figure is one)?"
    q = float(quoted.replace(",", ""))
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    tolerance = 0.5 * 10 ** -decimals + 1e-9
    candidates = [value, value * 100] if unit in ("%", "points") else [value]
    return any(abs(c - q) <= tolerance for c in candidates)


def quoted_figures(nb: dict) -> list[tuple[int, str, str | None]]:
    "(markdown cell index, figure, unit) for each marked figure."
    found = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "markdown":
            found += [(i, m.group(1), m.group(2)) for m in QUOTED.finditer("".join(cell["source"]))]
    return found


def nearby_outputs(nb: dict, i: int) -> str:
    "The stored outputs of the NEAR code cells before and the NEAR after markdown cell `i`."
    code = [j for j, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    before = [j for j in code if j < i][-NEAR:]
    after = [j for j in code if j > i][:NEAR]
    return "\n".join(output_text(nb["cells"][j]) for j in before + after)


def wrong_figures(nb: dict) -> list[str]:
    "A line for each marked figure that no nearby output prints."
    wrong = []
    for i, figure, unit in quoted_figures(nb):
        values = printed_numbers(nearby_outputs(nb, i))
        if not any(matches(figure, unit, v) for v in values):
            wrong.append(f"cell {i}: the prose quotes {figure}{unit or ''}, which no output of the {NEAR} code cells "
                         f"before or after it prints (they print {sorted(set(values))[:30]})")
    return wrong


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.stem)
def test_quoted_figures_are_printed(path):
    "Every figure a tutorial's prose marks as read from an output is what that output prints."
    wrong = wrong_figures(json.loads(path.read_text()))
    assert not wrong, f"{path.name}:\n" + "\n".join(wrong)


def test_the_tutorials_mark_their_figures():
    "The convention is in use, so the check above checks something."
    counts = {p.stem: len(quoted_figures(json.loads(p.read_text()))) for p in TUTORIALS}
    assert sum(counts.values()) >= 10, counts


def _notebook(prose: str, printed: str) -> dict:
    return {"cells": [{"cell_type": "code", "source": ["x"], "outputs": [
        {"output_type": "stream", "name": "stdout", "text": [printed]}]},
        {"cell_type": "markdown", "source": [prose]}]}


def test_a_wrong_figure_fails_and_a_rounded_one_passes():
    "The check can fail: a figure the output contradicts is named; rounding, percents and thousands pass."
    assert wrong_figures(_notebook("the jitter roughly doubles: 2.0x<!--out-->", "ratio 1.46x"))
    assert not wrong_figures(_notebook("the jitter grows 1.5x<!--out-->", "ratio 1.46x"))
    assert not wrong_figures(_notebook("accuracy 21%<!--out--> before", "{'greedy_accuracy': 0.208}"))
    assert not wrong_figures(_notebook("1,977<!--out--> prompts", "dataset_size 1977"))
    assert wrong_figures(_notebook("1.24 GiB<!--out-->", "total 2.05 GiB"))


def _record(path: Path, name: str) -> dict:
    "The literal `name = {...}` assigned in one of the notebook's code cells."
    import ast
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            for node in ast.parse("".join(line for line in cell["source"] if not line.startswith("#|"))).body:
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
                    return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} assigns no {name}")


def test_measured_records_are_the_benchmarks_figures():
    "The full runs drawn under the CPU twins are BENCHMARKS.md's measurements, figure for figure."
    bench = (ROOT / "BENCHMARKS.md").read_text()
    tool = _record(ROOT / "nbs/tutorials/07_teach_a_model_to_use_a_tool.ipynb", "TOOL_TOY_MEASURED")
    assert f"(seed 0, per step, 8 rollouts of one training prompt): `rewards/product_reward/mean` " \
           f"{', '.join(f'{v:g}' for v in tool[0])}" in " ".join(bench.split())
    for seed in (1, 2):
        assert f"seed {seed} {', '.join(f'{v:g}' for v in tool[seed])}" in " ".join(bench.split())
    demo = _record(ROOT / "nbs/tutorials/01_first_grpo_run.ipynb", "SMOLLM2_DEMO_MEASURED")
    for seed, (before, after) in demo.items():
        assert re.search(rf"\| SmolLM2-135M \| {seed} \| 20 \| \d+ \| {before:.1%} \| {after:.1%} \|", bench), seed


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        nb = json.loads(Path(arg).read_text())
        for i, figure, unit in quoted_figures(nb):
            print(f"cell {i}: {figure}{unit or ''}")
        print("\n".join(wrong_figures(nb)) or f"{arg}: every marked figure is printed nearby")
