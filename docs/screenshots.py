"""Screenshots of the built site in headless Chromium: the home page, a tutorial with math and a plot, a reference page.

    python docs/build.py && python docs/screenshots.py            # -> build/screenshots/*.png
    python docs/screenshots.py --site _docs --out shots --full-page

Each shot is taken after MathJax has typeset the page; the script prints, per page, how many formulas were typeset,
how many images loaded, and whether any raw `$$` is left in the text.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from browser import Browser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# page -> (file name, where to scroll to: a CSS selector whose element is put at the top, or None)
SHOTS = {
    "index.html": ("home.png", None),
    "tutorials/05_reward_curves.html": ("tutorial-math-and-plot.png", "mjx-container[display='true']"),
    "02_advantages.html": ("reference.png", "#compute-advantages"),
}

def scroll_to(browser: Browser, page: str, selector: str) -> None:
    "Scroll the first visible element matching `selector` to the top of the window."
    browser.evaluate(page, f"""(() => {{
      const el = [...document.querySelectorAll({json.dumps(selector)})].find(e => e.offsetParent !== null);
      if (!el) throw new Error('no visible element matches ' + {json.dumps(selector)});
      window.scrollBy(0, el.getBoundingClientRect().top - 120);
      return true;
    }})()""")


def take(site: Path, out: Path, full_page: bool = False, width: int = 1280, height: int = 1100) -> dict:
    "Take the shots; return {file name: the page's facts}."
    out.mkdir(parents=True, exist_ok=True)
    facts = {}
    with Browser() as browser:
        for page_path, (name, selector) in SHOTS.items():
            page = browser.open(site / page_path, width=width, height=height)
            browser.wait_for_math(page)
            if selector and not full_page:
                scroll_to(browser, page, selector)
            (out / name).write_bytes(browser.screenshot(page, full_page=full_page))
            facts[name] = {"page": page_path, **browser.page_facts(page)}
    return facts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=ROOT / "_docs", help="the built site (python docs/build.py)")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "screenshots")
    parser.add_argument("--full-page", action="store_true", help="whole pages instead of one screen each")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").exists():
        raise SystemExit(f"no site at {args.site}: build it first with `python docs/build.py`")
    for name, fact in take(args.site, args.out, args.full_page).items():
        print(f"{args.out / name}: {fact['page']}, {fact['formulas']} formulas typeset, "
              f"{sum(drawn for _, drawn in fact['images'])} of {len(fact['images'])} images drawn, "
              f"raw $$ left: {fact['raw_math']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
