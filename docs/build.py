"""Build the documentation website from the notebooks: `python docs/build.py` writes it to `_docs/`.

The notebooks in `nbs/` stay the source of truth. This script reads them as they are stored (outputs included;
nothing is executed), turns nbdev's cell directives into what the site shows, and hands the result to Sphinx
with myst-nb (settings in `docs/conf.py`):

- home: `nbs/index.ipynb` (the README's source); the course: `nbs/tutorials/*.ipynb` in file order; the reference:
  `nbs/[0-9]*.ipynb` in file order; then `BENCHMARKS.md`. The page list is globbed, never written down, so a new
  notebook is a new page;
- `#| hide`, `#| default_exp` and `#| exporti` cells are left out, `#| export` cells are replaced by the
  `show_doc` of each public function and class they define (its signature and docstring, from the installed
  `grpo_lab`), and `#| exports` cells are shown after it, as nbdev's own site does; `#| ...` lines are not shown;
- a code cell right after a collapsed `<details>` exercise solution is collapsed too (it runs the solution);
- a stored widget (its state in words, since widgets need a kernel) gets a note saying so;
- links to other notebooks become links to their pages, links to other files of the repository go to GitHub.

    python docs/build.py                  # -> _docs/index.html; a Sphinx warning is an error
    python docs/build.py --out site --keep-warnings
"""
from __future__ import annotations

import argparse
import ast
import configparser
import copy
import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
STAGE = ROOT / "build" / "docs-src"          # the processed sources Sphinx reads (build/ is git-ignored)
DOCTREES = ROOT / "build" / "docs-doctrees"
OUT = ROOT / "_docs"                          # settings.ini's doc_path
sys.path.insert(0, str(ROOT))                 # this checkout's grpo_lab, installed or not
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
HIDDEN = {"hide", "default_exp", "exporti"}
SHOW_DOC = {"export", "exports"}


def settings(root: Path = ROOT) -> configparser.SectionProxy:
    "settings.ini's [DEFAULT] section (nbdev 2's project settings)."
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(root / "settings.ini", encoding="utf-8")
    return cfg["DEFAULT"]


def github_blob(root: Path = ROOT) -> str:
    "https://github.com/USER/REPO/blob/BRANCH, from settings.ini."
    cfg = settings(root)
    return f"{cfg['git_url'].rstrip('/')}/blob/{cfg['branch']}"


def pages(root: Path = ROOT) -> dict[str, list[Path]]:
    "The site's pages by section, globbed from the files: home, course (tutorials), reference (modules), more."
    nbs = root / "nbs"
    return {"home": [nbs / "index.ipynb"],
            "course": sorted((nbs / "tutorials").glob("[0-9]*.ipynb")),
            "reference": sorted(nbs.glob("[0-9]*.ipynb")),
            "more": [root / "BENCHMARKS.md"]}


def page_name(path: Path, root: Path = ROOT) -> str:
    "Where a source file lives in the site (and in the staged sources): nbs/ is the site's root."
    rel = path.relative_to(root)
    return rel.relative_to("nbs").as_posix() if rel.parts[0] == "nbs" else rel.as_posix()


# --- nbdev directives -------------------------------------------------------------------------------------

def directives(source: str) -> dict[str, str]:
    "The `#| name value` lines that open a cell, as nbdev reads them."
    found = {}
    for line in source.splitlines():
        if not line.startswith("#|"):
            break
        name, _, value = line[2:].strip().partition(" ")
        found[name.rstrip(":")] = value.strip()
    return found


def without_directives(source: str) -> str:
    "The cell as a reader sees it: no `#|` lines."
    return "\n".join(line for line in source.splitlines() if not line.startswith("#|")).strip("\n")


def public_names(source: str) -> list[str]:
    "Names nbdev's `show_doc` documents for an exported cell: top-level functions and classes not starting with _."
    showdoc_nm = _import_showdoc().showdoc_nm
    tree = ast.parse(source)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [showdoc_nm(node) for node in tree.body
            if isinstance(node, kinds) and (not node.name.startswith("_") or node.name.startswith("__"))]


def _import_showdoc():
    "nbdev.showdoc (nbdev 2 imports pkg_resources, which setuptools warns about: not this site's concern)."
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from nbdev import showdoc
    return showdoc


def resolve(module, name: str):
    "The object `name` (`f` or `Class.method`) of `module`."
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def show_doc_markdown(obj, name: str, source_url: str | None, level: int = 3) -> str:
    "nbdev's `show_doc` of `obj` (signature, docstring, parameter table) written as MyST markdown."
    showdoc = _import_showdoc()
    doc = showdoc.ShowDocRenderer(obj, name=name)
    parts = [f"{'#' * level} {name}"]
    if doc.sig is not None:
        kind = "class" if isinstance(obj, type) else "def"
        params = [_param(p) for k, p in doc.sig.parameters.items() if k != "self"]
        line = f"{kind} {name.split('.')[-1]}({', '.join(params)})"
        if len(line) > 100:                    # one parameter per line, as a formatter would write it
            line = f"{kind} {name.split('.')[-1]}(\n" + "".join(f"    {p},\n" for p in params) + ")"
        block = f"```python\n{line}\n```"
        if len(params) > 20:                   # a config's hundred fields: folded, the docstring first in view
            block = f"<details><summary>Signature: {len(params)} parameters</summary>\n\n{block}\n\n</details>"
        parts.append(block)
    if doc.docs:
        parts.append(doc.docs)
    if doc.dm.has_docment:
        parts.append(str(doc.dm._repr_markdown_()))
    if source_url:
        parts.append(f"[source]({source_url})")
    return "\n\n".join(parts)


def _param(param) -> str:
    "One parameter as Python writes it (`name: type = default`), a function default by its name."
    import inspect
    text = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "") + param.name
    if param.annotation is not param.empty:
        text += f": {inspect.formatannotation(param.annotation)}"
    if param.default is not param.empty:
        default = param.default
        text += " = " + (default.__name__ if inspect.isfunction(default) else repr(default))
    return text


def source_url(obj, blob: str) -> str | None:
    "The GitHub address of the lines defining `obj` in the package, or None when they cannot be found."
    import inspect
    try:
        obj = inspect.unwrap(obj)
        path = Path(inspect.getsourcefile(obj)).resolve()
        line = inspect.getsourcelines(obj)[1]
        return f"{blob}/{path.relative_to(ROOT).as_posix()}#L{line}"
    except (TypeError, OSError, ValueError):
        return None


# --- widgets -------------------------------------------------------------------------------------------

def widget_classes(cells: list[dict]) -> set[str]:
    "Names of the classes whose instances are grpo-lab widgets: Explorer's subclasses, the package's and the notebook's."
    from grpo_lab import widgets
    names = {"Explorer"}
    names |= {c.__name__ for c in _subclasses(widgets.Explorer)}
    for tree in _trees(cells):
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) in names for b in node.bases):
                names.add(node.name)
    return names


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _trees(cells):
    for cell in cells:
        if cell["cell_type"] == "code":
            try:
                yield ast.parse(without_directives("".join(cell["source"])))
            except SyntaxError:
                continue


def _makes_widget(node, classes) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) in classes


def widget_cells(cells: list[dict]) -> dict[int, str]:
    "Code cells that end by showing a widget: index -> the widget's class."
    classes = widget_classes(cells)
    variables: dict[str, str] = {}
    shown = {}
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse(without_directives("".join(cell["source"])))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and isinstance(
                        node.value, ast.Tuple) else [(target, node.value)]
                    for t, v in pairs:
                        if isinstance(t, ast.Name) and _makes_widget(v, classes):
                            variables[t.id] = v.func.id
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr) and any(o["output_type"] == "execute_result" for o in cell.get("outputs", [])):
            if _makes_widget(last.value, classes):
                shown[i] = last.value.func.id
            elif isinstance(last.value, ast.Name) and last.value.id in variables:
                shown[i] = variables[last.value.id]
    return shown


def widget_note(cls: str, colab: str) -> dict:
    text = (f"```{{note}}\nIn Jupyter, VS Code or Colab the cell above draws `{cls}` as an interactive widget. "
            f"A widget needs a running Python kernel, which a web page does not have, so the page shows the "
            f"widget's state in words (its `repr`) and as a picture. [Open this notebook in Colab]({colab}) to use it.\n```")
    return _markdown(text)


def text_and_picture(cell: dict) -> dict:
    """A widget cell with its result split in two outputs, the text then the picture: a page shows one part of a
    bundle only (the picture, of one holding both), and the text holds the widget's tables."""
    outputs = []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if out["output_type"] == "execute_result" and {"image/png", "text/plain"} <= data.keys():
            outputs += [{**out, "data": {"text/plain": data["text/plain"]}},
                        {"output_type": "display_data", "data": {"image/png": data["image/png"]}, "metadata": {}}]
        else:
            outputs.append(out)
    return {**cell, "outputs": outputs}


# --- links -----------------------------------------------------------------------------------------------

_LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def rewrite_links(text: str, page: Path, page_paths: dict[Path, str], root: Path = ROOT) -> str:
    "Relative links: to a page -> that page (relative to this one); to another repository file -> GitHub."
    here = page_name(page, root)

    def fix(match):
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):
            return match.group(0)
        path, _, anchor = target.partition("#")
        for base in (page.parent, root):          # the README's links are relative to the repository's root
            file = (base / path).resolve()
            if file.exists() and root in file.parents:
                break
        else:
            return match.group(0)                 # Sphinx reports it
        if file in page_paths:
            new = Path(os.path.relpath(page_paths[file], os.path.dirname(here) or ".")).as_posix()
        else:
            new = f"{github_blob(root)}/{file.relative_to(root).as_posix()}"
        return f"{match.group(1)}{new}{'#' + anchor if anchor else ''}{match.group(3)}"

    return _LINK.sub(fix, text)


# --- one notebook ------------------------------------------------------------------------------------------

def _markdown(text: str) -> dict:
    global _made
    _made += 1
    return {"cell_type": "markdown", "id": f"docs-{_made}", "metadata": {}, "source": text}


_made = 0
_HEADING = re.compile(r"^(#{1,6}) ", re.M)


def colab_url(page: Path, root: Path = ROOT) -> str:
    cfg = settings(root)
    user_repo = cfg["git_url"].rstrip("/").split("github.com/")[-1]
    return f"https://colab.research.google.com/github/{user_repo}/blob/{cfg['branch']}/{page.relative_to(root).as_posix()}"


def process_notebook(path: Path, page_paths: dict[Path, str], root: Path = ROOT) -> dict:
    "The notebook as its page shows it (see the module docstring)."
    import importlib
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    module = None
    for cell in cells:
        d = directives("".join(cell["source"])) if cell["cell_type"] == "code" else {}
        if "default_exp" in d and d["default_exp"] != "__init__":
            module = importlib.import_module(f"{settings(root)['lib_path']}.{d['default_exp']}")
    widgets_shown = widget_cells(cells)
    blob = github_blob(root)
    out, after_solution, level = [], False, 1
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            # the site carries its own badge, so that a page needs nothing from another server
            source = source.replace(COLAB_BADGE, os.path.relpath("colab-badge.svg", os.path.dirname(
                page_name(path, root)) or "."))
            after_solution = source.lstrip().startswith("<details>")
            levels = [len(h) for h in _HEADING.findall(re.sub(r"```.*?```", "", source, flags=re.S))]
            level = levels[-1] if levels else level
            out.append(_markdown(rewrite_links(source, path, page_paths, root)))
            continue
        if cell["cell_type"] != "code":
            continue
        d = directives(source)
        if d.keys() & HIDDEN:
            continue
        if d.keys() & SHOW_DOC:
            target = importlib.import_module(f"{settings(root)['lib_path']}.{d['export']}") if d.get("export") \
                else module
            if target is None:
                raise ValueError(f"{path.name}, cell {i}: an #| export cell without `#| default_exp` in the notebook; "
                                 "add `#| default_exp MODULE` (nbdev needs it to export the cell too).")
            for name in public_names(without_directives(source)):
                try:
                    obj = resolve(target, name)
                except AttributeError:
                    raise ValueError(f"{path.name}, cell {i} defines {name}, which {target.__name__} lacks: the "
                                     "package is not what the notebooks export; run nbdev_export.") from None
                doc_level = min(level + 1, 4)      # under the section it is in
                out.append(_markdown(show_doc_markdown(obj, name, source_url(obj, blob), doc_level)))
            if "exports" not in d:
                continue
        shown = copy.deepcopy(cell)
        shown["source"] = without_directives(source)
        shown["metadata"] = {}
        if after_solution:
            shown["metadata"] = {"tags": ["hide-cell"], "mystnb": {"code_prompt_show": "Show the solution's run",
                                                                   "code_prompt_hide": "Hide the solution's run"}}
        out.append(shown)
        if i in widgets_shown:
            out[-1] = text_and_picture(shown)
            out.append(widget_note(widgets_shown[i], colab_url(path, root)))
    for n, cell in enumerate(out):            # nbformat 4.5 wants an id on every cell
        cell.setdefault("id", f"cell-{n}")
    nb["cells"] = out
    return nb


def toctree_cell(sections: dict[str, list[Path]], root: Path = ROOT) -> dict:
    "The sidebar: one hidden toctree per section, in file order."
    captions = {"course": "Course", "reference": "Reference", "more": "More"}
    blocks = []
    for key, caption in captions.items():
        entries = "\n".join(str(Path(page_name(p, root)).with_suffix("").as_posix()) for p in sections[key])
        blocks.append(f"```{{toctree}}\n:hidden:\n:caption: {caption}\n:maxdepth: 1\n\n{entries}\n```")
    return _markdown("\n\n".join(blocks))


def stage(root: Path = ROOT, stage_dir: Path = STAGE) -> list[str]:
    "Write the processed sources for Sphinx; rewrite only what changed, so that a rebuild reads only those."
    sections = pages(root)
    every = [p for ps in sections.values() for p in ps]
    missing = [p for p in every if not p.exists()]
    if missing:
        raise FileNotFoundError(f"pages not found: {missing}")
    page_paths = {p.resolve(): page_name(p, root) for p in every}
    wanted = {}
    for p in every:
        if p.suffix == ".ipynb":
            nb = process_notebook(p, page_paths, root)
            if p == sections["home"][0]:
                nb["cells"].append(toctree_cell(sections, root))
            wanted[page_name(p, root)] = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
        else:
            wanted[page_name(p, root)] = rewrite_links(p.read_text(encoding="utf-8"), p, page_paths, root)
    wanted["colab-badge.svg"] = (DOCS / "colab-badge.svg").read_text(encoding="utf-8")
    stage_dir.mkdir(parents=True, exist_ok=True)
    for old in [f for f in stage_dir.rglob("*") if f.is_file()]:
        if old.relative_to(stage_dir).as_posix() not in wanted:
            old.unlink()
    for name, text in wanted.items():
        dst = stage_dir / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists() or dst.read_text(encoding="utf-8") != text:
            dst.write_text(text, encoding="utf-8")
    return list(wanted)


def build(out: Path = OUT, strict: bool = True, root: Path = ROOT, quiet: bool = True) -> int:
    "Stage the sources and run Sphinx; return its exit status (non-zero on an error, or on a warning if strict)."
    from sphinx.cmd.build import build_main
    stage(root)
    args = ["-b", "html", "-c", str(DOCS), "-d", str(DOCTREES), "-j", "auto", str(STAGE), str(out)]
    if strict:
        args[:0] = ["-W", "--keep-going"]
    if quiet:
        args[:0] = ["-q"]
    return build_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="folder to write the site to (default: _docs)")
    parser.add_argument("--keep-warnings", action="store_true", help="do not fail on Sphinx warnings")
    args = parser.parse_args(argv)
    started = time.time()
    status = build(args.out.resolve(), strict=not args.keep_warnings)
    if status == 0:
        print(f"built {args.out / 'index.html'} in {time.time() - started:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
