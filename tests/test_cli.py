"""The grpo-lab command line, run as a user runs it: a subprocess of the installed console script."""
import json
import subprocess

import pytest

from conftest import ROOT, bin_path


def grpo_lab(*args, cwd=ROOT, timeout=600):
    return subprocess.run([bin_path("grpo-lab"), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["demo"], ["train"], ["plan"], ["export"]])
def test_every_command_has_help(cmd):
    r = grpo_lab(*cmd, "--help")
    assert r.returncode == 0 and "usage: grpo-lab" in r.stdout


def test_plan_prints_the_worked_example():
    r = grpo_lab("plan", "--pd", 4, "--ga", 2, "--gpus", 3, "-G", 6, "-N", 8000, "--num-train-epochs", 2, "--explain")
    assert r.returncode == 0, r.stderr
    assert "2000" in r.stdout and "4000" in r.stdout and "24" in r.stdout


def test_plan_error_exits_2_with_the_rule_and_the_fixes():
    r = grpo_lab("plan", "--pd", 1, "--gpus", 7, "-G", 8)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    for fix in ("num_generations=7", "num_processes=8", "gradient_accumulation_steps=8"):
        assert fix in r.stderr


@pytest.mark.parametrize("args, words", [
    (["demo", "--steps", "0"], "must be >= 1"),
    (["demo", "--bogus"], "unrecognized arguments"),
    (["train", "--config", "no-such.yaml"], "does not exist"),
    (["train", "--config", "configs/tiny-cpu.yaml", "--num_generation", "4"], "num_generations"),
    (["train", "--config", "configs/tiny-cpu.yaml", "--num_generations", "3"], "divisible"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_without_a_traceback(args, words):
    r = grpo_lab(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr


def test_train_from_the_shipped_cpu_config_with_overrides(tmp_path):
    out = tmp_path / "run"
    r = grpo_lab("train", "--config", "configs/tiny-cpu.yaml", "--max_steps", 4, "--logging_steps", 2,
                 "--save_steps", 2, "--output_dir", out, "--disable_tqdm")
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged] == [2, 4]
    assert (out / "checkpoint-4").exists() and (out / "final" / "model.safetensors").exists()
    r = grpo_lab("train", "--config", "configs/tiny-cpu.yaml", "--max_steps", 6, "--output_dir", out,
                 "--disable_tqdm", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6


def test_the_colab_config_describes_a_valid_run():
    "The T4 config needs the hub to run; offline we check it parses into a valid plan and known rewards."
    from grpo_lab.cli import load_run, resolve_reward
    model, dataset, rewards, args = load_run(ROOT / "configs" / "colab-t4-qwen-gsm8k.yaml", {})
    assert model == "Qwen/Qwen2.5-0.5B-Instruct" and dataset["source"] == "openai/gsm8k"
    assert args.load_in_4bit and args.lora_r == 16 and args.plan.unique_prompts_per_generation == 4
    assert [resolve_reward(r).__name__ for r in rewards] == rewards


def test_demo_writes_its_artifacts(tmp_path):
    out = tmp_path / "demo"
    r = grpo_lab("demo", "--steps", 3, "--eval-size", 30, "--eval-every", 3, "--output-dir", out)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and set(summary) >= {"accuracy_before", "accuracy_after", "seconds"}
    assert (out / "metrics.jsonl").exists() and (out / "curves.png").exists()
    assert (out / "final" / "config.json").exists()
    assert "held-out greedy accuracy" in r.stdout
