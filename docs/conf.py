"""Sphinx settings of the documentation site. Build with `python docs/build.py` (it stages the sources first).

Sphinx + myst-nb reads the stored notebooks as they are (no execution), MathJax is served from the site itself
(no CDN: the site works offline and in a sandboxed browser), and the search index is Sphinx's own.
"""
import importlib.util
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from build import settings  # noqa: E402

cfg = settings()
project = cfg["title"]
author = cfg["author"]
copyright = cfg["copyright"]
release = version = cfg["version"]

extensions = ["myst_nb", "sphinx.ext.mathjax"]
root_doc = "index"
exclude_patterns = []

# Notebooks: shown with their stored outputs, never executed here (the tests execute them).
nb_execution_mode = "off"
nb_output_stderr = "remove"
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]

# MathJax 3 from the site itself: the SVG component (no web fonts needed) and the TeX extensions it loads on
# demand, copied from the sphinx-mathjax-offline package (on PyPI; its files, not its Sphinx hook).
_mathjax = Path(importlib.util.find_spec("sphinx-mathjax-offline").origin).parent / "static" / "mathjax"
mathjax_path = "mathjax/tex-svg.js"


def _copy_mathjax(app, exception):
    if exception is None:
        dst = Path(app.outdir) / "_static" / "mathjax"
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(_mathjax / "tex-svg.js", dst / "tex-svg.js")
        shutil.copytree(_mathjax / "input" / "tex" / "extensions", dst / "input" / "tex" / "extensions",
                        dirs_exist_ok=True)


def _outputs_in_build(app):
    "myst-nb writes notebook outputs next to the site's folder (jupyter_execute/); keep them in build/ instead."
    folder = Path(app.doctreedir).parent / "docs-outputs"
    app.env.mystnb_config = app.env.mystnb_config.copy(output_folder=str(folder),
                                                       execution_cache_path=str(folder / ".jupyter_cache"))


def setup(app):
    app.connect("builder-inited", _outputs_in_build, priority=900)     # after myst-nb's own (priority 500)
    app.connect("build-finished", _copy_mathjax)


# The look: sphinx-book-theme (the classic Jupyter Book layout), with a Colab launch button on notebook pages.
html_theme = "sphinx_book_theme"
html_title = "grpo-lab"
html_baseurl = f"{cfg['doc_host'].rstrip('/')}{cfg['doc_baseurl'].rstrip('/')}/"
html_static_path = ["_static"]
html_css_files = ["grpo-lab.css"]
html_show_sourcelink = False
html_theme_options = {
    "repository_url": cfg["git_url"],
    "repository_branch": cfg["branch"],
    "path_to_docs": "nbs",
    "use_repository_button": True,
    "launch_buttons": {"colab_url": "https://colab.research.google.com"},
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
