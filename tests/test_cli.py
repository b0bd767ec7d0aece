"""The grpo-lab command line, run as a user runs it: a subprocess of the installed console script."""
import json
import subprocess
import sys

import pytest

from conftest import ROOT, bin_path


def grpo_lab(*args, cwd=ROOT, timeout=600):
    return subprocess.run([bin_path("grpo-lab"), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cmd", [[], ["demo"], ["train"], ["plan"], ["export"], ["config"]])
def test_every_command_has_help(cmd):
    r = grpo_lab(*cmd, "--help")
    assert r.returncode == 0 and "usage: grpo-lab" in r.stdout


def test_plan_prints_the_worked_example():
    r = grpo_lab("plan", "--pd", 4, "--ga", 2, "--gpus", 3, "-G", 6, "-N", 8000, "--num-train-epochs", 2, "--explain")
    assert r.returncode == 0, r.stderr
    assert "2000" in r.stdout and "4000" in r.stdout and "24" in r.stdout


NO_TORCH = ("import sys; from grpo_lab.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('heavy:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")


@pytest.mark.parametrize("args", [["plan", "--pd", "4", "--ga", "2", "--gpus", "3", "-G", "6", "-N", "8000"],
                                  ["--help"], ["plan", "--pd", "1", "--gpus", "7"]])
def test_plan_and_help_import_neither_torch_nor_transformers(args):
    r = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120)
    assert "heavy: []" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])


def test_plan_answers_huge_values_with_fixes():
    r = grpo_lab("plan", "--pd", 1000000, "--ga", 100, "-N", 10, timeout=60)
    assert r.returncode == 2 and "dataset_size=12500000" in r.stderr and "num_generations=10000000" in r.stderr
    r = grpo_lab("plan", *[x for flag in ("--pd", "--ga", "--gpus", "-N") for x in (flag, 10**12)], "-G", 7, timeout=60)
    assert r.returncode == 2 and "num_generations=" in r.stderr and "Traceback" not in r.stderr


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
    (["train", "--config", "configs/tiny-cpu.yaml", "--learning_rate", "abc"], "learning_rate='abc' on the command line"),
    (["train", "--config", "configs/tiny-cpu.yaml", "--max_steps", "0"], "max_steps=0 would train nothing"),
    (["train", "--config", "configs"], "is a folder"),
    (["plan", "--pd", "4", "--ga", "2", "--max-steps", "0"], "max_steps=0 would train nothing"),
])
def test_bad_arguments_exit_2_without_a_traceback(args, words):
    r = grpo_lab(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert words in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("text, words", [
    ("- model: tiny\n", "holds a YAML list, not a mapping"),
    ("42\n", "holds a YAML single value (int)"),
    ("model: [tiny\n", "is not valid YAML"),
    ("a: &a [x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nmodel: [*b, *b, *b, *b]\n"
     "dataset: {task: arithmetic}\nrewards: exact_answer\n", "a YAML alias (*a)"),
    ("model: tiny\ndataset: {task: arithmetic, size: 9}\nrewards: exact_answer\n", "unknown key 'size'"),
    ("model: tiny\ndataset: {task: arithmetic}\nrewards: exact_answer\nnum_train_epochs: 1.5\n", "whole number"),
])
def test_bad_run_files_exit_2_naming_the_file_and_the_rule(tmp_path, text, words):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    r = grpo_lab("train", "--config", cfg, "--output_dir", tmp_path / "out", timeout=300)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr) < 1000


def test_a_huge_run_file_is_refused_before_it_is_read(tmp_path):
    cfg = tmp_path / "big.yaml"
    cfg.write_text("model: tiny\n# " + "x" * 2_000_000 + "\n")
    r = grpo_lab("train", "--config", cfg, timeout=120)
    assert r.returncode == 2 and "is at most 1,000,000 bytes" in r.stderr


def test_export_never_overwrites_without_being_asked(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "README.md").write_text("my notes")
    args = ["export", "--config", "configs/tiny-cpu.yaml", "--gpus", 2]
    r = grpo_lab(*args, "-o", out)
    assert r.returncode == 2 and "already holds README.md" in r.stderr and "--overwrite" in r.stderr
    assert (out / "README.md").read_text() == "my notes" and not (out / "run.yaml").exists()
    r = grpo_lab(*args, "-o", out / "README.md")
    assert r.returncode == 2 and "is a file" in r.stderr
    r = grpo_lab(*args, "-o", out, "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "run.yaml").exists() and (out / "README.md").read_text() != "my notes"


def test_demo_refuses_a_folder_holding_another_runs_files(tmp_path):
    out = tmp_path / "used"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "completions.jsonl").write_text("{}\n")
    r = grpo_lab("demo", "--steps", 1, "--output-dir", out, timeout=300)
    assert r.returncode == 2 and "already holds files" in r.stderr and "--overwrite" in r.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and (out / "completions.jsonl").exists()
    r = grpo_lab("demo", "--steps", 1, "--output-dir", out / "metrics.jsonl", timeout=300)
    assert r.returncode == 2 and "is a file" in r.stderr


INTERRUPT = ("import sys, grpo_lab.trainer as t\n"
             "from grpo_lab.cli import main\n"
             "def stop(self, resume_from_checkpoint=None):\n"
             "    raise t.TrainingInterrupted(step=7, checkpoint=__import__('pathlib').Path('out/checkpoint-7'))\n"
             "t.GRPOTrainer.train = stop\n"
             "sys.exit(main(sys.argv[1:]))")


def test_ctrl_c_in_train_reports_the_checkpoint_and_exits_130(tmp_path):
    "The trainer raises TrainingInterrupted after saving; the command names the step, the checkpoint and `--resume`."
    pytest.importorskip("grpo_lab.trainer").__dict__.get("TrainingInterrupted") or pytest.skip("trainer rewrite not landed")
    r = subprocess.run([sys.executable, "-c", INTERRUPT, "train", "--config", "configs/tiny-cpu.yaml",
                        "--output_dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 130, r.stderr[-3000:]
    assert "interrupted at step 7, checkpoint-7 saved; resume with: grpo-lab train --config configs/tiny-cpu.yaml" in r.stderr
    assert "--resume" in r.stderr and "final policy" not in r.stdout + r.stderr


def test_train_from_the_shipped_cpu_config_with_overrides(tmp_path):
    out = tmp_path / "run"
    r = grpo_lab("train", "--config", "configs/tiny-cpu.yaml", "--max_steps", 4, "--logging_steps", 2,
                 "--save_steps", 2, "--output_dir", out, "--disable_tqdm")
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    *steps, summary = logged                      # the last line is the run's summary, as the HF Trainer logs it
    assert [h["step"] for h in steps] == [2, 4] and summary["step"] == 4 and "train_loss" in summary
    assert (out / "checkpoint-4").exists() and (out / "model.safetensors").exists()
    assert f"final policy: {out}" in r.stdout
    r = grpo_lab("train", "--config", "configs/tiny-cpu.yaml", "--max_steps", 6, "--output_dir", out,
                 "--disable_tqdm", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6


def test_the_colab_config_describes_a_valid_run():
    "The T4 config needs the hub to run; offline we check it parses into a valid plan and known rewards."
    from grpo_lab.batching import plan_for
    from grpo_lab.cli import load_run, resolve_reward
    model, dataset, rewards, args, shortcuts = load_run(ROOT / "configs" / "colab-t4-qwen-gsm8k.yaml", {})
    assert model == "Qwen/Qwen2.5-0.5B-Instruct" and dataset["source"] == "openai/gsm8k"
    assert shortcuts == {"load_in_4bit": True, "lora_r": 16, "lora_alpha": 32} and plan_for(args).unique_prompts_per_generation == 4
    assert [resolve_reward(r).__name__ for r in rewards] == rewards


def test_demo_writes_its_artifacts(tmp_path):
    out = tmp_path / "demo"
    r = grpo_lab("demo", "--steps", 3, "--eval-size", 30, "--eval-every", 3, "--output-dir", out)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and set(summary) >= {"accuracy_before", "accuracy_after", "seconds"}
    assert (out / "metrics.jsonl").exists() and (out / "curves.png").exists()
    assert (out / "config.json").exists()
    assert "held-out greedy accuracy" in r.stdout
