"""benchmarks/gpu_check.sh in its dry mode (CPU, tiny shapes): every stage runs and the report has the GPU run's format.

The GPU run itself (`bash benchmarks/gpu_check.sh` on an H100/H200, about 7.5 minutes) cannot run here; this keeps its
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

STAGES = ["environment", "cuda_tests", "bench_0.5b_bf16_lora", "bench_1.5b_qlora", "t4_rehearsal", "demo", "sharded"]


def gpu_check(out, *args, timeout=900):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DRY": "1", "GPU_CHECK_SITE": str(out / "site")}
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
    bench = by_name["bench_0.5b_bf16_lora"]["figures"]
    assert bench["grpo-lab"]["tokens_per_s"] > 0 and bench["grpo-lab"]["peak_memory_mib"] > 0
    if "ratio" in bench:                         # TRL installed: the comparison's figures are there too
        assert bench["trl"]["total"] > 0 and bench["ratio"]["peak_memory_mib"] > 0
    t4 = by_name["t4_rehearsal"]["figures"]
    assert t4["steps"] == 1 and t4["t4_limit_mib"] == 15360 and t4["estimate_mib"] >= 0 and t4["peak_memory_mib"] > 0
    demo = by_name["demo"]["figures"]
    assert demo["steps"] == 2 and 0 <= demo["accuracy_before"] <= 1
    assert by_name["sharded"]["figures"]["fsdp"]["distributed_type"] == "DistributedType.FSDP"     # 2 CPU processes
    markdown = (out / "report.md").read_text()
    assert "DRY RUN" in markdown and "| stage | status |" in markdown and all(f"## {n}" in markdown for n in STAGES)
    with tarfile.open(out / "gpu-check-logs.tar.gz") as tar:
        names = tar.getnames()
    assert any(n.endswith("pytest.log") for n in names) and any(n.endswith("bench.json") for n in names), names


def test_a_stage_out_of_time_is_recorded_and_the_exit_status_says_so(tmp_path):
    "A stage left without time is recorded as skipped with the reason; the check exits 1 (not every stage passed)."
    r = gpu_check(tmp_path, "--only", "demo", "--budget", "12", timeout=300)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    (stage,) = report["stages"]
    assert stage["status"] == "skipped" and "out of time" in stage["error"]
    assert report["summary"]["not_passed"] == ["demo"]


def test_unknown_stage_is_refused_with_the_list(tmp_path):
    r = gpu_check(tmp_path, "--only", "benchmark", timeout=120)
    assert r.returncode == 2 and "unknown stage" in r.stderr and "cuda_tests" in r.stderr
