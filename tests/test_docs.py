"""The documentation site builds from a fresh copy of the repository with the README's command, without a warning;
its page list follows the files; every internal link resolves; a browser shows typeset math and loaded images."""
import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import ROOT


def _load(path: Path):
    "A script of the repository as a module (without putting its folder on sys.path)."
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


browser = _load(ROOT / "docs" / "browser.py")
Browser, find_chromium = browser.Browser, browser.find_chromium

BUILD = [sys.executable, "docs/build.py"]          # the README's command, run from the repository's root


def _extra_notebooks(repo: Path) -> list[str]:
    "A tutorial and a module notebook the site has never seen: they must become pages, in order, without a config edit."
    tutorial = json.loads((repo / "nbs/tutorials/02_batch_arithmetic.ipynb").read_text())
    tutorial["cells"][0]["source"] = "# Tutorial 99: a page nobody listed\n\n> Added by tests/test_docs.py."
    (repo / "nbs/tutorials/99_unlisted.ipynb").write_text(json.dumps(tutorial))
    module = json.loads((repo / "nbs/00_batching.ipynb").read_text())
    module["cells"][0]["source"] = "# Unlisted module\n\n> Added by tests/test_docs.py."
    (repo / "nbs/99_unlisted.ipynb").write_text(json.dumps(module))
    return ["tutorials/99_unlisted", "99_unlisted"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "The site built by `python docs/build.py` in a copy of the tracked files (what a fresh clone has) plus two notebooks."
    missing = [m for m in ("sphinx", "myst_nb", "sphinx_book_theme") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"the docs tools are not installed ({', '.join(missing)}): pip install -e '.[docs]' (or '.[dev]')")
    repo = tmp_path_factory.mktemp("clone")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    extra = _extra_notebooks(repo)
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(BUILD, cwd=repo, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"the docs build failed (a Sphinx warning is an error):\n{done.stdout[-5000:]}\n" \
                                 f"{done.stderr[-5000:]}"
    return {"out": repo / "_docs", "repo": repo, "extra": extra, "log": done.stdout + done.stderr}


def test_the_build_reports_no_warning(site):
    assert "WARNING" not in site["log"] and "ERROR" not in site["log"], site["log"][-3000:]
    assert re.search(r"built .*index\.html in [\d.]+ s", site["log"])


def _sidebar(out: Path) -> list[str]:
    "The pages the home page's sidebar links to, in order."
    html = (out / "index.html").read_text()
    start = html.index("bd-docs-nav")
    nav = html[start:html.index("</nav>", start)]
    return [h.removesuffix(".html") for h in re.findall(r'class="reference internal" href="([^"#]+)"', nav)]


def test_every_notebook_is_a_page_in_file_order(site):
    repo, out = site["repo"], site["out"]
    tutorials = [f"tutorials/{p.stem}" for p in sorted((repo / "nbs/tutorials").glob("[0-9]*.ipynb"))]
    modules = [p.stem for p in sorted((repo / "nbs").glob("[0-9]*.ipynb"))]
    assert set(site["extra"]) <= {*tutorials, *modules}
    for page in ["index", *tutorials, *modules, "BENCHMARKS"]:
        assert (out / f"{page}.html").is_file(), f"no page for {page}"
    sidebar = _sidebar(out)
    assert [p for p in sidebar if p.startswith("tutorials/")] == tutorials, sidebar
    assert [p for p in sidebar if p in modules] == modules, sidebar
    assert "BENCHMARKS" in sidebar


class _Refs(HTMLParser):
    "Every id, and every local href/src, of one page."

    def __init__(self):
        super().__init__()
        self.ids, self.refs = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and "name" in attrs:
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key) and tag in ("a", "img", "link", "script", "source", "iframe"):
                self.refs.append(attrs[key])


def _parse(path: Path) -> _Refs:
    parser = _Refs()
    parser.feed(path.read_text(errors="replace"))
    return parser


def test_every_internal_link_resolves(site):
    "Each relative href/src of every page names a file of the site, and each #anchor an id on that page."
    out = site["out"]
    pages = {p: _parse(p) for p in out.rglob("*.html") if "_static" not in p.parts}   # _static: theme templates
    broken, checked = [], 0
    for page, parsed in pages.items():
        for ref in parsed.refs:
            parts = urlsplit(ref)
            if parts.scheme or ref.startswith("//"):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            checked += 1
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(out)}: {ref} (no such file)")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(out)}: {ref} (no id {parts.fragment!r} there)")
    assert checked > 1000 and not broken, f"{len(broken)} broken of {checked}:\n" + "\n".join(broken[:40])


def test_reference_pages_show_doc_each_public_function(site):
    "An exported cell is replaced by the signature and docstring of what it defines, as nbdev's show_doc shows it."
    from grpo_lab.advantages import compute_advantages, nanstd
    html = (site["out"] / "02_advantages.html").read_text()
    for func in (compute_advantages, nanstd):
        assert f'id="{func.__name__.replace("_", "-")}"' in html, func.__name__
        assert func.__doc__.split("`")[0].split("(")[0].strip() in html
    assert "num_generations" in html and "scale_rewards" in html
    assert "def _weights" not in html, "an #| export cell's code is shown"
    assert "#|" not in html, "an nbdev directive is shown"
    index = (site["out"] / "index.html").read_text()
    assert "_LAZY" not in index, "a #| hide cell is shown"


def test_notebook_pages_keep_their_outputs_and_open_in_colab(site):
    out = site["out"]
    tutorial = (out / "tutorials/03_loss_normalization.html").read_text()
    assert re.search(r'<img [^>]*src="\.\./_images/[^"]+\.png"', tutorial), "a stored plot is missing"
    colab = "https://colab.research.google.com/github/grpo-lab/grpo-lab/blob/main/nbs/"
    for page in [*(out / "tutorials").glob("*.html"), *out.glob("[0-9]*.html"), out / "index.html"]:
        name = page.relative_to(out).with_suffix(".ipynb").as_posix()
        assert f'href="{colab}{name}"' in page.read_text(), f"{name}: no Open-in-Colab link to its notebook"


def test_exercise_solutions_and_their_runs_are_collapsed(site):
    html = (site["out"] / "tutorials/01_first_grpo_run.html").read_text()
    assert re.search(r"<details>\s*<summary>Solution 1</summary>", html)
    assert re.search(r"Show the solution(&#x27;|'|&#8217;)s run", html), "a solution's run is not collapsed"


def test_a_widget_says_it_needs_a_kernel(site):
    html = (site["out"] / "02_advantages.html").read_text()
    assert "draws <code class=\"docutils literal notranslate\"><span class=\"pre\">AdvantageExplorer</span></code> " \
           "as an interactive widget" in html
    assert "needs a running Python kernel" in (site["out"] / "07_widgets.html").read_text()


def test_search_index_holds_the_reference(site):
    index = (site["out"] / "searchindex.js").read_text()
    assert "compute_advantages" in index and (site["out"] / "search.html").is_file()


def test_settings_and_the_pages_workflow_agree():
    """settings.ini's doc_host/doc_baseurl are where GitHub Pages publishes this repository; the workflow builds with
    the README's command and uploads the folder it writes."""
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(ROOT / "settings.ini")
    cfg = cfg["DEFAULT"]
    user, repo = cfg["git_url"].rstrip("/").split("/")[-2:]
    assert cfg["doc_host"] == f"https://{user}.github.io" and cfg["doc_baseurl"] == f"/{repo}"
    workflow = (ROOT / ".github/workflows/pages.yml").read_text()
    assert "python docs/build.py" in workflow and f"path: {cfg['doc_path']}" in workflow
    assert "actions/deploy-pages" in workflow and "branches: [main]" in workflow
    assert "python docs/build.py" in (ROOT / "README.md").read_text()
    docs_extra = set(cfg["docs_requirements"].split())
    assert docs_extra and docs_extra <= set(cfg["dev_requirements"].split())


def test_a_browser_typesets_the_math_and_loads_the_images(site):
    "Headless Chromium opens a tutorial and a reference page from disk: no raw $$ left, every image drawn."
    if not find_chromium():
        if os.environ.get("GRPO_LAB_REQUIRE_BROWSER"):
            pytest.fail("GRPO_LAB_REQUIRE_BROWSER is set but no Chromium is installed")
        pytest.skip("no Chromium here (Debian: apt-get update && apt-get install -y chromium); .ci/run installs it")
    with Browser() as browser:
        for page, min_formulas, min_plots in (("tutorials/03_loss_normalization.html", 20, 2),
                                              ("02_advantages.html", 10, 1)):
            tab = browser.open(site["out"] / page)
            browser.wait_for_math(tab)
            facts = browser.page_facts(tab)
            assert facts["formulas"] >= min_formulas and not facts["raw_math"], (page, facts)
            broken = [src for src, ok in facts["images"] if not ok]
            plots = [src for src, ok in facts["images"] if ok and src.endswith(".png")]
            assert not broken and len(plots) >= min_plots, (page, facts["images"])
