"""The tutorials and the widgets notebook run as a learner on Colab runs them (`.ci/colab_like.py`).

A Python 3.12 environment with the project's wheel alone (no extras) and ipywidgets 7.7.1, an empty model cache, and
the notebook's own Colab-only cell installing grpo-lab (from the local wheel), each notebook alone in an empty folder.
grpo-lab is not installed when a notebook starts, so a notebook that runs proves that its install cell worked. The
stored outputs are compared as tests/test_notebooks.py compares them, so this run can stand in for that one for
these notebooks.

The environment is kept in .cache/colab-venv (made again when settings.ini's requirements change). Every notebook a
learner runs (all tutorials, every module notebook, the index) is `python .ci/colab_like.py`; that full run does not
fit in CI's time budget, this part does.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("colab_like", ROOT / ".ci" / "colab_like.py")
colab_like = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(colab_like)
PYTHON, notebooks = colab_like.PYTHON, colab_like.notebooks

IN_THE_TEST_COMMAND = ["tutorials/", "07_widgets"]


def test_the_subset_is_every_tutorial_and_the_widgets_notebook():
    chosen = [p.relative_to(ROOT / "nbs").as_posix() for p in notebooks(IN_THE_TEST_COMMAND)]
    tutorials = sorted(p.relative_to(ROOT / "nbs").as_posix() for p in (ROOT / "nbs/tutorials").glob("[0-9]*.ipynb"))
    assert chosen == [*tutorials, "07_widgets.ipynb"]


@pytest.mark.slow
def test_tutorials_and_widgets_run_as_on_colab(tmp_path):
    if not os.environ.get("GRPO_LAB_COLAB_LIKE"):
        pytest.skip("opt-in (GRPO_LAB_COLAB_LIKE=1): a fresh Python 3.12 environment pulls torch's CUDA build (about "
                    "4.5 GB; these machines cache a CPU wheel for 3.11 only) and the run takes ~10 minutes, past CI's "
                    "budget; the full run is `python .ci/colab_like.py`")
    if not Path(PYTHON).exists():
        pytest.skip(f"no Python 3.12 at {PYTHON} (pyenv's 3.12.1), which the Colab-like environment is made with")
    results = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(ROOT / ".ci/colab_like.py"), *IN_THE_TEST_COMMAND,
                           "--check", "--venv", str(ROOT / ".cache/colab-venv"), "--json", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=3000)
    print(done.stdout)
    ran = json.loads(results.read_text()) if results.exists() else []
    failed = [r for r in ran if r["status"] != "ran"]
    assert done.returncode == 0 and ran and not failed, f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
