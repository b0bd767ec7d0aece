"""benchmarks/gpu_check.sh in its dry mode (CPU, tiny shapes): every stage runs and the report has the GPU run's format.

The GPU run itself (`bash benchmarks/gpu_check.sh` on an H100/H200, under 6 minutes) cannot run here; this keeps its
script, its stages and its report from rotting between GPU runs. About 90 s of CPU time (each stage starts Python
processes that import torch, transformers and TRL).
"""
import json
import os
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT

STAGES = ["environment", "t4_rehearsal", "engine_0.5b_bf16_lora", "bench_1.5b_qlora", "cuda_tests"]


def gpu_check(out, *args, timeout=900, env=None):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DRY": "1", "GPU_CHECK_SITE": str(out / "site"), **(env or {})}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(out / "report"), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_dry_run_runs_every_stage_and_writes_the_report(tmp_path):
    r = gpu_check(tmp_path)
    out = tmp_path / "report"
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check-logs.tar.gz", "report.json", "report.md"]
    report = json.loads((out / "report.json").read_text())
    assert report["dry_run"] is True and report["seconds"] <= report["budget_s"]
    assert [s["name"] for s in report["stages"]] == STAGES
    for stage in report["stages"]:
        assert stage["status"] == "passed", (stage["name"], stage.get("error"))
        assert stage["checks"] and all(c["ok"] in (True, None) for c in stage["checks"]), stage
        assert 0 < stage["seconds"] <= stage["budget_s"] + 10, stage
    by_name = {s["name"]: s for s in report["stages"]}
    env = by_name["environment"]["figures"]
    assert env["imports"]["grpo_lab.trainer"] == "ok" and env["versions"]["torch"] and env["install"]["status"]
    tests = by_name["cuda_tests"]["figures"]["counts"]
    assert tests["passed"] >= 1 and tests["failed"] == tests["error"] == 0, tests
    engine = by_name["engine_0.5b_bf16_lora"]["figures"]          # the static engine, then generate, at tiny shapes
    for run in ("grpo-lab static", "grpo-lab generate"):
        assert engine[run]["tokens_per_s"] > 0 and engine[run]["peak_memory_mib"] > 0, engine
    assert engine["generation_speedup_over_generate"] > 0 and engine["decode_ms_a_token"] > 0
    if "trl" in engine:                                         # TRL installed: the comparison's figures too
        assert engine["trl"]["total"] > 0 and engine["step_over_trl"] > 0
    qlora = by_name["bench_1.5b_qlora"]["figures"]
    assert qlora["grpo-lab auto"]["total"] > 0 and qlora["ended"] == {"auto": "finished"}
    t4 = by_name["t4_rehearsal"]["figures"]
    assert t4["steps"] == 2 and t4["t4_limit_mib"] == 15360 and t4["estimate_mib"] >= 0 and t4["peak_memory_mib"] > 0
    assert t4["engine"] == "GenerateEngine" and len(t4["seconds_a_step"]) == 2 and t4["projected_minutes_for_250_steps"] > 0
    markdown = (out / "report.md").read_text()
    assert "DRY RUN" in markdown and "| stage | status |" in markdown and all(f"## {n}" in markdown for n in STAGES)
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("pytest.log") for n in names) and any(n.endswith("bench.json") for n in names), names


def test_a_stage_that_runs_out_of_time_reports_what_it_measured(tmp_path):
    """The T4 rehearsal (dry) told that its deadline comes after one of its two steps: it stops, and the report says
    timeout with the step it did, its seconds and its peak memory (the path a GPU stage takes when its budget ends)."""
    r = gpu_check(tmp_path, "--only", "t4_rehearsal", env={"GPU_CHECK_DEADLINE_AFTER_STEPS": "1"}, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    (stage,) = json.loads((tmp_path / "report" / "report.json").read_text())["stages"]
    assert stage["status"] == "timeout", stage
    figures = stage["figures"]
    assert figures["steps"] == 1 and figures["max_steps"] == 2 and len(figures["seconds_a_step"]) == 1
    assert figures["peak_memory_mib"] > 0 and figures["seconds_a_step"][0] > 0
    (ran_every_step,) = [c for c in stage["checks"] if c["name"] == "ran every step within the budget"]
    assert ran_every_step["ok"] is False and "1 of 2 steps" in ran_every_step["detail"]
    assert "1 of 2 steps" in (tmp_path / "report" / "report.md").read_text()


def test_progress_of_a_killed_stage_is_read_back(tmp_path):
    "What a stage killed at its deadline leaves (the rehearsal's progress file, finished bench runs) is what it reports."
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_check import progress
    (tmp_path / "progress.json").write_text(json.dumps({"steps_done": 2, "seconds_a_step": [9.5, 4.1],
                                                        "peak_memory_mib": 9000}))
    run = tmp_path / "tmp" / "grpo-lab-bench-x"
    run.mkdir(parents=True)
    (run / "trl-0.json").write_text(json.dumps({"trainer": "trl", "peak_memory_mib": 5000.4,
                                                "steps": [{"total": 4.72}, {"total": 4.7}]}))
    (run / "settings.json").write_text("{}")
    assert progress(tmp_path) == {"steps_done": 2, "seconds_a_step": [9.5, 4.1], "peak_memory_mib": 9000,
                                  "finished_bench_runs": [{"trainer": "trl", "steps_done": 2,
                                                           "seconds_a_step": [4.72, 4.7], "peak_memory_mib": 5000}]}


def test_a_stage_out_of_time_is_recorded_and_the_exit_status_says_so(tmp_path):
    "A stage left without time is recorded as skipped with the reason; the check exits 1 (not every stage passed)."
    r = gpu_check(tmp_path, "--only", "demo", "--budget", "12", timeout=300)     # demo: an optional stage
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (stage,) = report["stages"]
    assert stage["status"] == "skipped" and "out of time" in stage["error"]
    assert report["summary"]["not_passed"] == ["demo"]


def test_unknown_stage_is_refused_with_the_list(tmp_path):
    r = gpu_check(tmp_path, "--only", "benchmark", timeout=120)
    assert r.returncode == 2 and "unknown stage" in r.stderr and "cuda_tests" in r.stderr
