"""A headless Chromium driven over the DevTools protocol on a pipe (no websocket, no driver package).

Used by `docs/screenshots.py` and `tests/test_docs.py` to look at the built site as a reader's browser shows it:

    with Browser() as browser:
        page = browser.open(Path("_docs/index.html"))
        browser.evaluate(page, "document.title")
        png = browser.screenshot(page, width=1280, height=900)
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage", "--hide-scrollbars",
         "--remote-debugging-pipe"]


def find_chromium() -> str | None:
    "Path of a Chromium binary (Debian's `chromium` package), or None."
    if os.access("/usr/lib/chromium/chromium", os.X_OK):      # Debian's binary (its /usr/bin/chromium is a script)
        return "/usr/lib/chromium/chromium"
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class BrowserError(RuntimeError):
    pass


def _above_4(fd: int) -> int:
    "The same pipe end on a descriptor >= 10, so that moving it to 3 or 4 in the child cannot clobber another."
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    "One headless Chromium with a fresh profile; `open` a file, `evaluate` JavaScript in it, take a `screenshot`."

    def __init__(self, binary: str | None = None, timeout: float = 60):
        self.binary = binary or find_chromium()
        if self.binary is None:
            raise BrowserError("no Chromium found: install Debian's package with "
                               "`apt-get update && apt-get install -y chromium`")
        self.timeout = timeout
        self._id = 0
        self._buffer = b""

    def __enter__(self):
        self.profile = tempfile.mkdtemp(prefix="grpo-lab-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        to_chrome_r, from_chrome_w = _above_4(to_chrome_r), _above_4(from_chrome_w)

        # Chromium reads commands on fd 3 and writes replies on fd 4: bash moves the pipes there.
        move = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.process = subprocess.Popen(["bash", "-c", move, self.binary, *FLAGS, f"--user-data-dir={self.profile}",
                                         "about:blank"], pass_fds=(to_chrome_r, from_chrome_w),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        return self

    def __exit__(self, *exc):
        try:
            self.send("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.time() > deadline or self.process.poll() is not None:
                raise BrowserError(f"Chromium did not answer within {self.timeout} s "
                                   f"(exit status {self.process.poll()})")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise BrowserError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def send(self, method: str, session: str | None = None, wait_event: str | None = None, **params) -> dict:
        "Send one DevTools command; return its result (after `wait_event` arrives, when given)."
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.time() + self.timeout
        result, seen_event = None, wait_event is None
        while result is None or not seen_event:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                result = reply["result"]
            elif wait_event and reply.get("method") == wait_event and reply.get("sessionId") == session:
                seen_event = True
        return result

    def open(self, path: Path, width: int = 1280, height: int = 900) -> str:
        "Load a local file in a new tab of the given size; return the tab's session once its `load` event fired."
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", session=session, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.send("Page.navigate", session=session, wait_event="Page.loadEventFired",
                  url=Path(path).resolve().as_uri())
        return session

    def evaluate(self, session: str, expression: str):
        "The value of a JavaScript expression in the page (promises awaited)."
        reply = self.send("Runtime.evaluate", session=session, expression=expression, awaitPromise=True,
                          returnByValue=True)
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression[:80]}: {reply['exceptionDetails'].get('text')} "
                               f"{reply['exceptionDetails'].get('exception', {}).get('description', '')}")
        return reply["result"].get("value")

    def wait_for_math(self, session: str) -> None:
        "Wait until MathJax (when the page loads it) has typeset the page."
        self.evaluate(session, "window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")

    def page_facts(self, session: str) -> dict:
        "Typeset formulas, whether raw `$$` is left in the article's prose (code aside), and each image: [src, drawn]."
        return self.evaluate(session, """(() => {
          const prose = document.querySelector('article').cloneNode(true);
          prose.querySelectorAll('pre, code, script').forEach(e => e.remove());
          return {formulas: document.querySelectorAll('mjx-container').length,
                  raw_math: prose.textContent.includes('$$'),
                  images: [...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])};
        })()""")

    def screenshot(self, session: str, full_page: bool = False) -> bytes:
        "PNG of the viewport (or of the whole page)."
        params = {"format": "png"}
        if full_page:
            size = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        return base64.b64decode(self.send("Page.captureScreenshot", session=session, **params)["data"])
