"""Run a notebook as nbdev_test does, and store or check the outputs of its teaching cells.

The notebooks are stored with their outputs (GitHub and the docs site show them). Each test run executes every
notebook again and compares what each cell prints or returns now with what is stored, so a stored output cannot
go stale: change the code and the test names the cell whose output changed.

    python tests/notebook_runner.py --store nbs/03_loss.ipynb     # execute and store the outputs
    python tests/notebook_runner.py --check nbs/03_loss.ipynb     # execute and compare (what the tests do)

Cells flagged `#| slow`, `#| gpu`, `#| hub` or `#| eval: false` are not run, nor `#| vllm` cells where vLLM does not
import (their stored outputs, if any, stay).
Floats are compared to two significant digits (another CPU may differ in the last bits), and a duration printed the
way the compact terminal prints it (`1.23 s/step`, `[done, step 4/4] 12.3 s`) is masked: wall-clock is never a result.
Cells whose output differs from run to run for another reason (throughput, memory, anything that depends on the
machine's load) carry `#| volatile`: they run, their output is stored, and only its kind is compared. Tutorials are
compared like module notebooks: a seeded training run of the tiny model on a CPU prints the same figures every time,
so only their timing cells are volatile. Error output (warnings, progress bars) is never stored.
"""
import argparse
import importlib.util
import base64
import io
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `#| vllm` cells need vLLM (a second virtual environment: see tests/test_vllm.py); they run where it imports
SKIP_FLAGS = {"slow", "gpu", "hub"} | (set() if importlib.util.find_spec("vllm") else {"vllm"})
MAX_TEXT = 4000              # characters kept of one text output: its start and its end (results come last)
HEAD_TEXT = 1000             # of which the start
MAX_NOTEBOOK_BYTES = 1_500_000


def directives(source: str) -> dict:
    "The `#| name: value` lines at the top of a cell."
    out = {}
    for line in source.splitlines():
        if not line.startswith("#|"):
            break
        name, _, value = line[2:].strip().partition(" ")
        out[name.rstrip(":")] = value.strip()
    return out


def skipped(cell: dict) -> bool:
    d = directives("".join(cell["source"]))
    return bool(SKIP_FLAGS & d.keys()) or d.get("eval", "").lower() == "false"


def _shrink_png(data: str) -> str:
    "Re-encode a PNG at most 700 px wide with a small palette when that makes it smaller (outputs stay small)."
    from PIL import Image
    img = Image.open(io.BytesIO(base64.b64decode(data)))
    if img.width > 700:
        img = img.resize((700, round(img.height * 700 / img.width)))
    buf = io.BytesIO()
    img.convert("RGB").quantize(colors=64).save(buf, format="PNG", optimize=True)
    small = base64.b64encode(buf.getvalue()).decode()
    return small if len(small) < len(data) else data


def shorten(text: str) -> str:
    """At most about MAX_TEXT characters of `text`: its first HEAD_TEXT and its last ones, with a line saying how much
    was left out between them. A training cell's result (held-out accuracy after a run) is printed last: keeping only
    the head would cut it off under the run's logs."""
    if len(text) <= MAX_TEXT:
        return text
    head, tail = text[:HEAD_TEXT], text[-(MAX_TEXT - HEAD_TEXT):]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} characters left out ...]\n{tail}"


def clean_outputs(outputs: list) -> list:
    "Keep what a reader needs: no stderr, text cut to MAX_TEXT characters, images compressed, no widget state."
    kept = []
    for out in outputs:
        out = dict(out)
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            continue
        if out.get("output_type") == "stream":
            text = "".join(out["text"]) if isinstance(out["text"], list) else out["text"]
            out["text"] = shorten(text)
        if "data" in out:
            data = {k: v for k, v in out["data"].items() if not k.startswith("application/vnd.jupyter.widget")}
            for k, v in data.items():
                text = "".join(v) if isinstance(v, list) else v
                data[k] = _shrink_png(text) if k == "image/png" else shorten(text) if k.startswith("text/") else v
            out["data"] = data
            out["metadata"] = {}
            if out["output_type"] == "execute_result":
                out["execution_count"] = None
        kept.append(out)
    return kept


_NOISE = [(re.compile(r"0x[0-9a-f]{6,}"), "0x…"), (re.compile(r"/tmp/[\w./-]+"), "/tmp/…"),
          # durations as the compact terminal prints them: `0.26 s/step`, `[done, step 4/4] 1.2 s (0.30 s/step)`
          (re.compile(r"(?<![\w.])\d+(?:\.\d+)? s(?:/step)?(?![\w/])"), "… s"),
          # and as `trainer.train()`'s TrainOutput reports them
          (re.compile(r"'(train_runtime|train_samples_per_second|train_steps_per_second)': [\d.e+-]+"), r"'\1': …")]
_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e[-+]?\d+)?|(?<![\w.])-?\d+e[-+]?\d+")


def _two_digits(match) -> str:
    "A float to two significant digits, and ~0 below 1e-4: the figure must agree, not the last bits of a sum."
    value = float(match.group())
    return "~0" if abs(value) < 1e-4 else f"{value:.2g}"


def signature(outputs: list) -> list:
    "What is compared: the kind of each output and its text (addresses and temporary paths masked)."
    sig = []
    for out in outputs:
        kind = out["output_type"]
        if kind == "stream":
            text = out["text"]
        elif "data" in out:
            text = out["data"].get("text/plain", "")
            kind += "+image" if "image/png" in out["data"] else ""
        else:
            text = out.get("ename", "")
        text = "".join(text) if isinstance(text, list) else text
        for pattern, mask in _NOISE:
            text = pattern.sub(mask, text)
        text = _FLOAT.sub(_two_digits, text)
        sig.append((kind, text.strip()))
    return sig


_CUT = re.compile(r"\n\[\.\.\. \d+ characters left out \.\.\.\]\n")


def _complete_lines(text: str) -> tuple[list, list]:
    "The whole lines of a shortened text's head and tail (the lines the cut went through are left out)."
    head, tail = _CUT.split(text, 1)
    return head.split("\n")[:-1], tail.split("\n")[1:]


def same_output(a: tuple, b: tuple) -> bool:
    """Two outputs' signatures agree. A long output is stored shortened (its head and its tail), and where the cut falls
    depends on the lengths of the lines before it, which a masked duration (`6.66 s/step`, `26.66 s/step`) can change:
    so two shortened texts agree when the whole lines both kept, at the head and at the tail, are the same."""
    if a == b:
        return True
    (kind_a, text_a), (kind_b, text_b) = a, b
    if kind_a != kind_b or not (_CUT.search(text_a) and _CUT.search(text_b)):
        return False
    (head_a, tail_a), (head_b, tail_b) = _complete_lines(text_a), _complete_lines(text_b)
    n, m = min(len(head_a), len(head_b)), min(len(tail_a), len(tail_b))
    return n > 0 and m > 0 and head_a[:n] == head_b[:n] and tail_a[len(tail_a) - m:] == tail_b[len(tail_b) - m:]


def same_signature(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same_output(x, y) for x, y in zip(a, b))


def execute(path: Path) -> dict:
    "Execute the notebook at `path` as nbdev_test would; return its JSON with fresh outputs on the cells that ran."
    from execnb.nbio import dict2nb
    from execnb.shell import CaptureShell
    raw = json.loads(path.read_text())
    nb = dict2nb(json.loads(path.read_text()))
    os.environ["IN_TEST"] = "1"
    shell = CaptureShell(path)
    ran = set()
    cwd = os.getcwd()
    os.chdir(path.parent)
    try:
        for i, (cell, raw_cell) in enumerate(zip(nb.cells, raw["cells"])):
            if cell.cell_type != "code" or skipped(raw_cell):
                continue
            shell.cell(cell)
            if shell.exc:
                raise RuntimeError(f"{path.name}, cell {i}:\n{''.join(raw_cell['source'])[:500]}\n\n"
                                   f"{shell.prettytb(fname=path)}")
            raw_cell["outputs"] = clean_outputs([dict(o) for o in cell.get("outputs", [])])
            ran.add(i)
    finally:
        os.chdir(cwd)
    return raw, ran


def store(path: Path, runs: int = 2) -> None:
    "Execute (twice), store the outputs, and mark `#| volatile` the cells whose output differs between the runs."
    first, ran = execute(path)
    second, ran = execute(path) if runs > 1 else (first, ran)
    for i in ran:
        a, b = first["cells"][i], second["cells"][i]
        if not same_signature(signature(a["outputs"]), signature(b["outputs"])) and \
                "volatile" not in directives("".join(b["source"])):
            b["source"] = ["#| volatile\n"] + b["source"]
    path.write_text(json.dumps(second, indent=1, ensure_ascii=False) + "\n")


def check(path: Path) -> list[str]:
    "Execute and compare with the stored outputs; return a description of each stale cell."
    stored = json.loads(path.read_text())
    fresh, ran = execute(path)
    stale = []
    for i in sorted(ran):
        old, new = stored["cells"][i], fresh["cells"][i]
        volatile = "volatile" in directives("".join(old["source"]))
        a, b = signature(old["outputs"]), signature(new["outputs"])
        if volatile:
            a, b = [k for k, _ in a], [k for k, _ in b]
        if (a != b) if volatile else not same_signature(a, b):
            stale.append(f"cell {i} ({''.join(old['source'])[:80]!r}): stored {str(a)[:300]} but now {str(b)[:300]}")
    return stale


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--once", action="store_true", help="store from one run (no volatile detection)")
    parser.add_argument("notebooks", nargs="+", type=Path)
    a = parser.parse_args()
    for nb_path in a.notebooks:
        if a.store:
            started = time.time()
            store(nb_path.resolve(), runs=1 if a.once else 2)
            print(f"{nb_path}: {time.time() - started:.0f} s")
            print(f"stored {nb_path} ({nb_path.stat().st_size / 1e3:.0f} kB)")
        else:
            problems = check(nb_path.resolve())
            print(f"{nb_path}: " + ("up to date" if not problems else "\n  ".join(["STALE", *problems])))
            sys.exit(1 if problems else 0)
