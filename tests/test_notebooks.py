"""Every notebook in nbs/ executes (nbdev's test runner), and the library is in sync with them."""
import subprocess

import pytest

from conftest import ROOT, bin_path

NOTEBOOKS = sorted(p.relative_to(ROOT / "nbs").as_posix() for p in (ROOT / "nbs").rglob("*.ipynb")
                   if ".ipynb_checkpoints" not in p.parts and not p.name.startswith("_"))


def test_there_are_notebooks():
    assert "00_batching.ipynb" in NOTEBOOKS and "index.ipynb" in NOTEBOOKS


@pytest.mark.parametrize("nb", NOTEBOOKS)
def test_notebook_runs(nb):
    "nbdev_test runs each notebook headless; cells flagged slow|gpu|hub are skipped."
    r = subprocess.run([bin_path("nbdev_test"), "--path", f"nbs/{nb}", "--do_print"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{nb} failed under nbdev_test:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


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
    "nbdev_clean changes no notebook (no outputs, execution counts or stray metadata)."
    _commit(repo_copy)
    subprocess.run([bin_path("nbdev_clean")], cwd=repo_copy, check=True, capture_output=True)
    assert _changed(repo_copy) == "", "run nbdev_clean and commit nbs/:\n" + _changed(repo_copy)
