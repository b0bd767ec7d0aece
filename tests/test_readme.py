"""README.md is rendered from nbs/index.ipynb (nbdev's readme_nb), so the two never drift apart.

Regenerate it with `python tests/test_readme.py` after editing the index notebook.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = ("hide", "default_exp", "export")


def _directives(src: str) -> list[str]:
    return [line[3:].strip() for line in src.splitlines() if line.startswith("#|")]


def render_readme(nb_path=ROOT / "nbs" / "index.ipynb") -> str:
    "Markdown cells as they are; shown code cells in python fences, without nbdev directives."
    parts = []
    for cell in json.loads(Path(nb_path).read_text())["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            parts.append(src.strip())
        elif not any(d.split()[0].rstrip(":") in SKIP for d in _directives(src) if d):
            code = "\n".join(line for line in src.splitlines() if not line.startswith("#|")).strip()
            parts.append(f"```python\n{code}\n```")
    return "\n\n".join(parts) + "\n"


def test_readme_is_rendered_from_the_index_notebook():
    assert (ROOT / "README.md").read_text() == render_readme(), "run: python tests/test_readme.py"


def readme_snippets(nb_path=ROOT / "nbs" / "index.ipynb") -> list[str]:
    "The Python snippets the README shows that need no hub, GPU or long run, as the README shows them."
    snippets = []
    for cell in json.loads(Path(nb_path).read_text())["cells"]:
        src = "".join(cell["source"])
        flags = {d.split()[0].rstrip(":") for d in _directives(src) if d}
        if cell["cell_type"] == "code" and not flags & {*SKIP, "hub", "gpu", "slow", "eval"}:
            snippets.append("\n".join(line for line in src.splitlines() if not line.startswith("#|")).strip())
    return snippets


def test_every_readme_snippet_runs_as_written(tmp_path):
    "Each snippet runs alone in a fresh interpreter: nothing hidden (an import, a variable) is assumed."
    import subprocess
    snippets = readme_snippets()
    assert snippets and all(f"```python\n{s}\n```" in (ROOT / "README.md").read_text() for s in snippets)
    for code in snippets:
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"README snippet failed:\n{code}\n{r.stderr[-3000:]}"


def test_readme_names_the_test_command_that_ci_runs():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest" in readme
    assert [line for line in ci.splitlines() if line.startswith("python -m pytest")] == ['python -m pytest "${pytest_args[@]}" || status=$?']


# --- the docs say what the code does (issue 41) -----------------------------------------------------------------------

DOCS = {"README.md": ROOT / "README.md", "BENCHMARKS.md": ROOT / "BENCHMARKS.md", "nbs/index.ipynb": ROOT / "nbs" / "index.ipynb"}


def named_symbols(text: str) -> set[str]:
    "Every `grpo_lab.module.name` the text names, and every name a `from grpo_lab.x import a, b` line imports."
    import re
    names = set(re.findall(r"\bgrpo_lab(?:\.[A-Za-z_]\w*)+", text))
    for module, imported in re.findall(r"from (grpo_lab(?:\.\w+)*) import ([\w, ]+)", text):
        names |= {f"{module}.{n.strip()}" for n in imported.split(",") if n.strip()}
    return {n for n in names if not re.fullmatch(r"[A-Z]", n.rsplit(".", 1)[1])}     # `from grpo_lab import X`: a placeholder


def resolves(name: str) -> bool:
    "True when `name` is an importable module, or an attribute chain of one."
    import importlib
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_grpo_lab_symbol_the_docs_name_exists():
    "BENCHMARKS named grpo_lab.trainer.REFUSED_OPTIONS, which lives in grpo_lab.config (issue 41)."
    missing = {f"{doc}: {name}" for doc, path in DOCS.items() for name in named_symbols(path.read_text())
               if not resolves(name)}
    assert missing == set()


def figures(text: str) -> dict[str, set[str]]:
    "The figures tagged `<value><!--fig:name-->`: name -> the values written (a name may be tagged more than once)."
    import re
    found = {}
    for value, name in re.findall(r"(\S+?)<!--fig:([\w.-]+)-->", text):
        found.setdefault(name, set()).add(value.strip("*`("))       # **0.66x** and 0.66x are one figure
    return found


def test_readme_and_benchmarks_quote_the_same_figures():
    """A figure the README quotes from a measurement is tagged `<!--fig:name-->` there and where BENCHMARKS.md records
    it; the two must agree, and each README tag must name a BENCHMARKS figure."""
    readme, benchmarks = figures(DOCS["README.md"].read_text()), figures(DOCS["BENCHMARKS.md"].read_text())
    assert len(readme) >= 10, "the README's measured figures are tagged"
    assert {n for n, v in {**readme, **benchmarks}.items() if len(v) > 1} == set(), "one value per figure and file"
    assert sorted(set(readme) - set(benchmarks)) == [], "README figures with no source in BENCHMARKS.md"
    differ = {n: (readme[n], benchmarks[n]) for n in readme if readme[n] != benchmarks[n]}
    assert differ == {}, f"README and BENCHMARKS.md quote different values: {differ}"


if __name__ == "__main__":
    (ROOT / "README.md").write_text(render_readme())
    print("wrote", ROOT / "README.md", file=sys.stderr)
