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


if __name__ == "__main__":
    (ROOT / "README.md").write_text(render_readme())
    print("wrote", ROOT / "README.md", file=sys.stderr)
