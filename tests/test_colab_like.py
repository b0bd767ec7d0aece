"""The tutorials, the async and the widgets notebooks run as a learner on Colab runs them (`.ci/colab_like.py`); no
notebook imports what a plain install lacks, unless the import is guarded.

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

IN_THE_TEST_COMMAND = ["tutorials/", "06l_async", "07_widgets"]


def test_the_subset_is_every_tutorial_the_async_and_the_widgets_notebooks():
    "06l_async: the module notebook that once imported TRL, and the one that starts a process of its own."
    chosen = [p.relative_to(ROOT / "nbs").as_posix() for p in notebooks(IN_THE_TEST_COMMAND)]
    tutorials = sorted(p.relative_to(ROOT / "nbs").as_posix() for p in (ROOT / "nbs/tutorials").glob("[0-9]*.ipynb"))
    assert chosen == [*tutorials, "06l_async.ipynb", "07_widgets.ipynb"]


def test_no_notebook_imports_what_a_plain_install_lacks_unless_guarded():
    """Every notebook (tutorials, module notebooks, the index), read rather than run: each import a cell runs names a
    module of the standard library, grpo_lab, or settings.ini's runtime requirements (and theirs); TRL, pytest and
    the other development packages only under an `if` or a `try`. The run above covers some notebooks; this, all."""
    allowed = colab_like.plain_install_modules()
    assert {"torch", "transformers", "datasets", "yaml", "numpy", "IPython"} <= allowed
    assert not allowed & {"trl", "pytest", "hypothesis", "nbdev", "execnb", "nbformat", "jmespath", "sphinx"}
    found = {nb.relative_to(ROOT / "nbs").as_posix(): bad for nb in notebooks()
             if (bad := colab_like.unguarded_imports(nb, allowed))}
    assert not found, f"imports a plain install lacks (guard them with importlib.util.find_spec): {found}"


def test_the_import_check_finds_an_unguarded_import_and_accepts_a_guarded_one(tmp_path):
    cells = ["import json\nfrom trl.experimental.async_grpo import AsyncGRPOConfig",
             "import importlib.util\nif importlib.util.find_spec('trl'):\n    import trl",
             "try:\n    import pytest\nexcept ImportError:\n    pytest = None",
             "def compare():\n    from trl import GRPOConfig\n    return GRPOConfig",
             "%%time\nimport hypothesis"]
    notebook = tmp_path / "n.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c} for c in cells]}))
    assert colab_like.unguarded_imports(notebook, colab_like.plain_install_modules()) == ["cell 0: trl",
                                                                                          "cell 4: hypothesis"]


@pytest.mark.slow
def test_tutorials_async_and_widgets_run_as_on_colab(tmp_path):
    if not os.environ.get("GRPO_LAB_COLAB_LIKE"):
        pytest.skip("opt-in (GRPO_LAB_COLAB_LIKE=1): a fresh Python 3.12 environment pulls torch's CUDA build (about "
                    "4.5 GB; these machines cache a CPU wheel for 3.11 only) and the run takes ~12 minutes, past CI's "
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
