"""Importing grpo-lab writes nothing to stderr: a learner reads any line there as a broken install.

Each check runs in a FRESH interpreter, because most notices (a dependency's logger, a `warnings.warn`) fire
once, when a module is first imported: a test process that imported it already would see nothing. The
modules are enumerated from the package folder, so a module added later is covered without touching this file.
"""
import argparse
import os
import pkgutil
import subprocess
import sys

import pytest

from conftest import ROOT, bin_path

MODULES = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "grpo_lab")]))


def _environment():
    "The user's environment, as a fresh shell has it: no warning filters that the test runner might have added."
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS",)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_quietly(command, timeout=300):
    "Run `command`; return its stdout after asserting that it succeeded and wrote nothing to stderr."
    r = subprocess.run(command, cwd=ROOT, env=_environment(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{command} failed ({r.returncode}):\n{r.stderr[-3000:]}"
    assert r.stderr == "", f"{command} wrote to stderr:\n{r.stderr[-3000:]}"
    return r.stdout


def python(code):
    return run_quietly([sys.executable, "-c", code])


def test_every_module_is_found():
    "pkgutil sees the package's modules (a wrong folder would make the parametrized tests below vacuous)."
    assert {"batching", "loss", "models", "trainer", "cli"} <= set(MODULES), MODULES


def test_import_grpo_lab_is_quiet():
    assert python("import grpo_lab; print(grpo_lab.__file__)").strip() == str(ROOT / "grpo_lab" / "__init__.py")


def test_the_trainer_import_is_quiet():
    "What every training script and TRL quick-start begins with."
    assert python("from grpo_lab import GRPOConfig, GRPOTrainer; print(GRPOTrainer.__name__)").strip() == "GRPOTrainer"


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports_quietly(module):
    assert python(f"import grpo_lab.{module} as m; print(m.__name__)").strip() == f"grpo_lab.{module}"


def _subcommands():
    from grpo_lab.cli import build_parser
    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sorted(actions[0].choices)


@pytest.mark.parametrize("command", [[]] + [[name] for name in _subcommands()], ids=lambda c: " ".join(["grpo-lab", *c]))
def test_every_command_starts_quietly(command):
    "`grpo-lab [command] --help`: the console script's start, which each command shares."
    assert "usage: grpo-lab" in run_quietly([bin_path("grpo-lab"), *command, "--help"])


def test_a_command_that_runs_is_quiet():
    "`grpo-lab plan` runs to its answer with nothing on stderr."
    assert "total_optimizer_steps" in run_quietly([bin_path("grpo-lab"), "plan", "--pd", "4", "--ga", "2", "-G", "4", "-N", "64"])


NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install kernels`"


def _log_from_bitsandbytes(message, *args):
    "Stderr of a fresh interpreter that imports grpo_lab and logs `message` as bitsandbytes' CPU backend does."
    code = ("import logging, sys, grpo_lab\n"
            f"logging.getLogger('bitsandbytes.backends.cpu.ops').warning({message!r}, *{args!r})")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_environment(), capture_output=True,
                          text=True, timeout=120).stderr


def test_only_the_kernel_notice_is_dropped():
    "The optional-kernel notice is dropped; any other record of bitsandbytes' CPU backend still reaches the user."
    assert _log_from_bitsandbytes(NOTICE, "No module named 'kernels'") == ""
    assert _log_from_bitsandbytes("Failed to load CPU gemm_4bit_forward: %s", "out of memory").strip() == \
        "Failed to load CPU gemm_4bit_forward: out of memory"
    assert _log_from_bitsandbytes("a genuine warning").strip() == "a genuine warning"
