"""Every notebook in nbs/ executes with its stored outputs still true, opens in Colab, and the library is in sync."""
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, bin_path
from notebook_runner import MAX_NOTEBOOK_BYTES, MAX_TEXT, clean_outputs, directives, same_signature, signature

NOTEBOOKS = sorted(p.relative_to(ROOT / "nbs").as_posix() for p in (ROOT / "nbs").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts and not p.name.startswith("_"))


def test_there_are_notebooks():
    assert "00_batching.ipynb" in NOTEBOOKS and "index.ipynb" in NOTEBOOKS


# Notebooks whose run is past CI's budget: their other checks below still apply; run them by hand with
# `python tests/notebook_runner.py --check nbs/<path>` (or GRPO_LAB_SLOW_NOTEBOOKS=1 here).
OVER_BUDGET: dict[str, str] = {}     # notebooks whose run is past CI's budget: {path: why} (none today)


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_notebook_runs_and_its_stored_outputs_are_current(nb):
    "Each notebook executes headless (cells flagged slow|gpu|hub skipped) and prints what its stored outputs show."
    if nb in OVER_BUDGET and not os.environ.get("GRPO_LAB_SLOW_NOTEBOOKS"):
        pytest.skip(f"{nb}: {OVER_BUDGET[nb]}")
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "notebook_runner.py"), "--check", f"nbs/{nb}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{nb}:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}\n" \
        f"(store fresh outputs with: python tests/notebook_runner.py --store nbs/{nb})"


def test_a_long_stored_output_keeps_its_end():
    "A training cell prints its logs, then its result: the stored output keeps the result, not only the logs' head."
    logs = "".join(f"{{'loss': '0.{i:03d}', 'reward': '0.5'}}\n" for i in range(400))
    result = "held-out greedy accuracy: 22.0% -> 41.5% (+19.5 points) after 100 steps\n"
    (kept,) = clean_outputs([{"output_type": "stream", "name": "stdout", "text": logs + result}])
    assert kept["text"].endswith(result) and kept["text"].startswith("{'loss': '0.000'")
    assert len(kept["text"]) <= MAX_TEXT + 100 and "characters left out" in kept["text"]


def test_durations_are_masked_and_results_are_compared():
    "Two runs of a seeded training cell differ only in wall-clock: same signature; a different reward is stale."
    line = "[step 10/100] reward {} ± 0.305 | length 3.5 | {} s/step\n[done, step 100/100] {} s ({} s/step) | train_loss 0.0024\n"
    run = lambda reward, *seconds: signature([{"output_type": "stream", "name": "stdout", "text": line.format(reward, *seconds)}])
    assert run("0.125", "1.89", "190.2", "1.90") == run("0.125", "30.44", "3101.5", "31.25")
    assert run("0.125", "1.89", "190.2", "1.90") != run("0.225", "1.89", "190.2", "1.90")


def test_a_shortened_output_compares_its_whole_lines():
    "Where a long output is cut depends on masked durations' lengths; the whole lines kept at both ends are compared."
    def stored(reward, seconds):
        lines = "".join(f"[step {i:>3}/400] reward {reward} | {seconds} s/step\n" for i in range(400))
        return signature(clean_outputs([{"output_type": "stream", "name": "stdout", "text": lines + "final 0.25\n"}]))
    assert stored("0.125", "6.66") != stored("0.125", "26.66")          # cut in other places
    assert same_signature(stored("0.125", "6.66"), stored("0.125", "26.66"))
    assert not same_signature(stored("0.125", "6.66"), stored("0.135", "26.66"))


def test_tutorials_are_compared_by_value():
    "Tutorial cells are compared like module notebooks'; only a few (timings, multi-process logs, async runs) are volatile."
    marked, total = 0, 0
    for nb in (n for n in NOTEBOOKS if n.startswith("tutorials/")):
        code = [c for c in json.loads((ROOT / "nbs" / nb).read_text())["cells"] if c["cell_type"] == "code"]
        total += len(code)
        marked += sum("volatile" in directives("".join(c["source"])) for c in code)
    assert total > 100 and marked <= 0.1 * total, (marked, total)


DEV_ONLY = re.compile(r"^\s*(import|from)\s+(pytest|hypothesis|nbdev|execnb|nbformat)\b", re.M)
INSTALL = 'if "google.colab" in sys.modules:\n    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "grpo-lab"], check=True)'


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_notebook_opens_in_colab_on_a_plain_install(nb):
    "Title and summary, a Colab link to this very notebook, the install cell, and no development-only import."
    cells = json.loads((ROOT / "nbs" / nb).read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells]
    title = next(i for i, c in enumerate(cells) if c["cell_type"] == "markdown")
    assert re.match(r"# .+\n\n> .+", sources[title]), f"{nb} must start with '# Title' and a '> summary' line"
    badge = f"https://colab.research.google.com/github/grpo-lab/grpo-lab/blob/main/nbs/{nb}"
    assert badge in sources[title + 1], f"{nb}: the cell after the title must link to {badge}"
    assert INSTALL in sources[title + 2], f"{nb}: the third cell must install grpo-lab in Colab only"
    code = [s for c, s in zip(cells, sources) if c["cell_type"] == "code"]
    assert not [s for s in code if DEV_ONLY.search(s)], f"{nb} imports a development-only package"


def test_stored_outputs_stay_small():
    "Outputs are kept for GitHub and the docs, within a budget: 1.5 MB per notebook."
    sizes = {nb: (ROOT / "nbs" / nb).stat().st_size for nb in NOTEBOOKS}
    assert max(sizes.values()) <= MAX_NOTEBOOK_BYTES, sizes


def _changed(root):
    return subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout


def _commit(root):
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "base", "--no-verify"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)


def test_library_matches_notebooks(repo_copy):
    "Exporting the notebooks again changes nothing in grpo_lab/."
    _commit(repo_copy)
    subprocess.run([bin_path("nbdev_export")], cwd=repo_copy, check=True, capture_output=True)
    assert _changed(repo_copy) == "", "run nbdev_export and commit grpo_lab/:\n" + _changed(repo_copy)


def test_notebooks_are_clean(repo_copy):
    "nbdev_clean changes no notebook (no execution counts or stray metadata; outputs are kept)."
    _commit(repo_copy)
    subprocess.run([bin_path("nbdev_clean")], cwd=repo_copy, check=True, capture_output=True)
    assert _changed(repo_copy) == "", "run nbdev_clean and commit nbs/:\n" + _changed(repo_copy)
