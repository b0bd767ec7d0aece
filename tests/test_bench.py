"""`grpo-lab bench`: its help, and the structure of a tiny run's output (never its speed: figures live in BENCHMARKS.md)."""
import json
import os
import subprocess
import sys
from importlib.util import find_spec

import pytest

from conftest import ROOT, bin_path

PHASES = ("generation", "scoring", "forward", "backward_update")
TINY = ["--shape", "tiny", "--steps", "2", "--pd", "8", "-G", "4", "--completion-length", "8", "--threads", "1", "--quiet"]
# TRL is optional: this Python if it has it, else one named by GRPO_LAB_TRL_PYTHON (e.g. a venv with trl and grpo-lab).
TRL_PYTHON = sys.executable if find_spec("trl") else os.environ.get("GRPO_LAB_TRL_PYTHON")


def bench(*args, timeout=900):
    return subprocess.run([bin_path("grpo-lab"), "bench", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_the_shapes_and_the_depth_cut():
    r = bench("--help")
    assert r.returncode == 0, r.stderr
    for words in ("--shape", "qwen2.5-0.5b", "--layers", "--trl-python", "--repeats"):
        assert words in r.stdout


def check_output(out, trainers: list[str]) -> dict:
    "The JSON and the plot exist; each run has its steps, phases that add up, tokens/s and a peak memory."
    result = json.loads((out / "bench.json").read_text())
    assert (out / "bench.png").stat().st_size > 1000
    assert {"settings", "description", "machine", "prompt_tokens", "trl", "runs", "summary"} <= set(result)
    assert [r["trainer"] for r in result["runs"]] == trainers
    for run in result["runs"]:
        assert len(run["steps"]) == 2 and run["peak_memory_mib"] > 50 and run["memory_kind"]
        for step in run["steps"]:
            assert all(step[p] >= 0 for p in ("generation", "scoring", "forward", "backward"))
            assert step["backward_update"] >= step["backward"] > 0
            assert sum(step[p] for p in PHASES) == pytest.approx(step["total"])
            assert step["generated_tokens"] > 0 and step["tokens_per_s"] > 0
    assert result["prompt_tokens"] == 16
    return result


def test_a_tiny_run_without_trl_writes_json_and_plot(tmp_path):
    r = bench(*TINY, "--repeats", "1", "--no-trl", "--output-dir", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = check_output(tmp_path, ["grpo-lab"])
    assert set(result["summary"]) == {"grpo-lab"} and "not installed" in result["trl"]
    assert "grpo-lab" in r.stdout and "bench.json" in r.stdout


@pytest.mark.skipif(TRL_PYTHON is None, reason="TRL is not installed here (set GRPO_LAB_TRL_PYTHON to a Python with trl)")
def test_a_tiny_run_against_trl_alternates_and_reports_ratios(tmp_path):
    r = bench(*TINY, "--repeats", "2", "--trl-python", TRL_PYTHON, "--output-dir", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    result = check_output(tmp_path, ["grpo-lab", "trl", "grpo-lab", "trl"])
    assert result["runs"][1]["versions"]["trl"] and result["runs"][0]["versions"]["grpo-lab"]
    ratio = result["summary"]["ratio"]
    assert set(ratio) >= {*PHASES, "total", "tokens_per_s", "peak_memory_mib"} and ratio["total"] > 0
    assert "lab/TRL" in r.stdout


def test_smollm2_is_skipped_with_a_reason_when_not_shipped(tmp_path):
    import grpo_lab.models
    if hasattr(grpo_lab.models, "smollm2_path"):
        pytest.skip("SmolLM2 is shipped in this install: nothing to skip")
    r = bench("--shape", "smollm2", "--output-dir", tmp_path)
    assert r.returncode == 0 and "skipped" in r.stderr and "smollm2_path" in r.stderr


def test_layers_refused_for_trained_weights(tmp_path):
    r = bench("--shape", "tiny", "--layers", "2", "--output-dir", tmp_path)
    assert r.returncode == 2 and "trained weights" in r.stderr and "Traceback" not in r.stderr


def test_fixed_length_makes_every_completion_full_length(tmp_path):
    "`--fixed-length` holds EOS back: every step generates completions x completion-length tokens."
    r = bench(*TINY, "--fixed-length", "--no-trl", "--output-dir", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run = json.loads((tmp_path / "bench.json").read_text())["runs"][0]
    assert [s["generated_tokens"] for s in run["steps"]] == [8 * 8] * 2
    assert "of exactly 8" in r.stdout


def test_generation_backends_script_reports_all_three(tmp_path):
    "benchmarks/generation_cb.py times padded generate, shared prefill and continuous batching (structure only)."
    out = tmp_path / "cb.json"
    r = subprocess.run([sys.executable, "benchmarks/generation_cb.py", "--shape", "tiny", "--prompts", "2", "-G", "2",
                        "--completion-length", "4", "--rounds", "2", "--threads", "1", "--json", str(out), "--cb-config",
                        '{"num_blocks": 4, "max_batch_tokens": 128, "page_size": 32}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert list(figures) == ["padded generate", "shared prefill", "continuous batching"]
    for name in ("padded generate", "shared prefill"):     # grpo-lab's own back-ends must run
        assert all(f["seconds"] > 0 and f["tokens"] >= 0 for f in figures[name]), figures[name]
    for name, runs in figures.items():
        assert len(runs) == 2 and all(("seconds" in f) != ("error" in f) for f in runs)
        assert name in r.stdout
