"""Checkpoints survive faults: SIGKILL at random moments, half-written folders, damaged files, pickled payloads."""
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer

TINY = str(tiny_model_path())

# One run that saves every step; it resumes from the newest complete checkpoint when there is one.
SCRIPT = """
import sys
from pathlib import Path
from transformers import TrainerCallback
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer

class Say(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        print("step", state.global_step, flush=True)

out = Path(sys.argv[1])
args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                  learning_rate=1e-3, logging_steps=1, disable_tqdm=True, max_steps=12,
                  gradient_checkpointing=False, save_strategy="steps", save_steps=1, save_total_limit=2,
                  overwrite_output_dir=True)   # a kill before the first checkpoint leaves logs: that start is replaced
trainer = GRPOTrainer(tiny_model_path(), exact_answer, args=args, train_dataset=arithmetic_task(64), callbacks=[Say()],
                      lora_r=4)
trainer.train(resume_from_checkpoint=any(out.glob("checkpoint-*")))
trainer.save_model()
print("done", flush=True)
"""


def run_until_killed(script, out, kill_after_step, delay):
    "Start the run, and SIGKILL it `delay` seconds after it reports `kill_after_step` (or let it finish)."
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1]) >= kill_after_step:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    return proc.returncode


def test_sigkill_at_random_moments_then_resume_reproduces_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    assert run_until_killed(SCRIPT, reference, kill_after_step=10 ** 9, delay=0) == 0
    rng, out, kills = random.Random(0), tmp_path / "killed", 0
    for kill_after in (2, 5, 8):
        code = run_until_killed(SCRIPT, out, kill_after, delay=rng.uniform(0.0, 0.08))
        kills += code == -signal.SIGKILL
    assert kills >= 2                                        # the runs really were killed mid-way
    assert run_until_killed(SCRIPT, out, kill_after_step=10 ** 9, delay=0) == 0
    a, b = load_file(reference / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13)) + [12]               # each step once, in order, then the run's summary


def small_run(out, **kw):
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                      learning_rate=1e-3, logging_steps=1, disable_tqdm=True, gradient_checkpointing=False,
                      save_strategy="steps", save_steps=1, **kw)
    return GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32))


def test_resume_skips_incomplete_checkpoints_and_names_them(tmp_path, caplog):
    small_run(tmp_path, max_steps=3).train()
    (tmp_path / "checkpoint-3" / "optimizer.pt").unlink()           # as if the run died while writing it
    (tmp_path / "tmp-checkpoint-4").mkdir()
    trainer = small_run(tmp_path, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="grpo_lab.checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    assert any("skipping checkpoint-3" in r.message and "optimizer.pt" in r.message for r in caplog.records)
    assert trainer.state.global_step == 4


def test_a_damaged_checkpoint_given_by_path_gets_an_error_naming_the_file(tmp_path):
    small_run(tmp_path, max_steps=2).train()
    weights = tmp_path / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])                # cut short
    with pytest.raises(ValueError, match="model.safetensors cannot be read"):
        small_run(tmp_path, max_steps=3).train(resume_from_checkpoint=tmp_path / "checkpoint-2")


class Payload:
    "A pickle that runs code when loaded."
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_never_runs_code_when_loaded(tmp_path):
    small_run(tmp_path, max_steps=2).train()
    marker = tmp_path / "payload-ran"
    for name in ("optimizer.pt", "scheduler.pt", "process_0.pt"):
        with open(tmp_path / "checkpoint-2" / name, "wb") as f:
            pickle.dump({"state": Payload(str(marker))}, f)
    with pytest.raises(ValueError, match="never loads"):
        small_run(tmp_path, max_steps=3).train(resume_from_checkpoint=True)
    assert not marker.exists()


def test_resume_with_other_batch_options_is_refused(tmp_path):
    small_run(tmp_path, max_steps=2).train()
    with pytest.raises(ValueError, match="per_device_train_batch_size: 8 -> 4"):
        GRPOTrainer(TINY, exact_answer, args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                                        num_generations=4, max_completion_length=5, max_steps=3,
                                                        disable_tqdm=True, gradient_checkpointing=False),
                    train_dataset=arithmetic_task(32)).train(resume_from_checkpoint=True)


def test_a_fresh_run_in_a_used_folder_with_overwrite_starts_a_clean_log(tmp_path):
    "Without overwrite_output_dir the second run is refused (tests/test_bad_input_2.py)."
    small_run(tmp_path, max_steps=2).train()
    small_run(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 1]                                   # the step, then the run's summary


def test_a_full_disk_while_saving_names_the_cause_and_the_checkpoint_that_survives(tmp_path, monkeypatch):
    import errno
    import grpo_lab.trainer as tr
    trainer = small_run(tmp_path, max_steps=3)
    real_save, calls = torch.save, []

    def save_until_the_disk_fills(obj, f, *a, **k):
        calls.append(f)
        if trainer.state.global_step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(tr.torch, "save", save_until_the_disk_fills)
    with pytest.raises(OSError, match="checkpoint-2 failed .*the disk is full.* newest complete checkpoint is checkpoint-1"):
        trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]


def test_push_to_hub_uploads_the_model_card_and_weights(tmp_path, monkeypatch):
    "Against a local stand-in for the Hub's API (tests never reach the network)."
    import shutil
    import huggingface_hub
    uploads = tmp_path / "hub"

    class LocalHub:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            (uploads / repo_id).mkdir(parents=True, exist_ok=exist_ok)

        def upload_folder(self, repo_id, folder_path, commit_message, ignore_patterns=(), revision=None,
                          run_as_future=False):                     # huggingface_hub's own signature, in part
            shutil.copytree(folder_path, uploads / repo_id, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(*ignore_patterns))
            return f"local://{repo_id}"

    monkeypatch.setattr(huggingface_hub, "HfApi", LocalHub)
    trainer = small_run(tmp_path / "out", max_steps=2, hub_model_id="me/tiny-grpo")
    trainer.train()
    assert trainer.push_to_hub() == "local://me/tiny-grpo"
    pushed = {p.name for p in (uploads / "me" / "tiny-grpo").iterdir()}
    assert {"model.safetensors", "tokenizer.json", "README.md"} <= pushed and not any(n.startswith("checkpoint") for n in pushed)
    assert "- grpo" in (uploads / "me" / "tiny-grpo" / "README.md").read_text()


def test_another_models_checkpoint_gets_one_sentence(tmp_path):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                disable_tqdm=True, gradient_checkpointing=False, save_strategy="steps", save_steps=1)
    GRPOTrainer(TINY, exact_answer, args=GRPOConfig(**args, max_steps=1), lora_r=8,
                train_dataset=arithmetic_task(32)).train()
    other = GRPOTrainer(TINY, exact_answer, args=GRPOConfig(**args, max_steps=2), train_dataset=arithmetic_task(32),
                        lora_r=4)
    with pytest.raises(ValueError, match="checkpoint-1 was written by another model") as e:
        other.train(resume_from_checkpoint=tmp_path / "checkpoint-1")
    assert len(str(e.value)) < 600


def test_resuming_a_finished_run_trains_nothing_logs_nothing_and_says_so(tmp_path, caplog):
    "A notebook re-run after the run finished: the HF Trainer and TRL train 0 steps; so does grpo-lab (it trained a 5th)."
    first = small_run(tmp_path, max_steps=4)
    first.train()
    first.save_model()                   # train() saves no final model (as TRL); a script asks for it
    metrics = (tmp_path / "metrics.jsonl").read_text()
    weights_before = (tmp_path / "model.safetensors").read_bytes()
    again = small_run(tmp_path, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="grpo_lab.trainer"):
        out = again.train(resume_from_checkpoint=True)
    assert out.global_step == again.state.global_step == 4
    assert not (tmp_path / "checkpoint-5").exists() and sorted(p.name for p in tmp_path.glob("checkpoint-*"))[-1] == "checkpoint-4"
    assert (tmp_path / "metrics.jsonl").read_text() == metrics                      # nothing new logged, nothing lost
    assert (tmp_path / "model.safetensors").read_bytes() == weights_before
    said = [r.message for r in caplog.records if "nothing left to train" in r.message]
    assert len(said) == 1 and "checkpoint-4" in said[0] and "step 4 of 4" in said[0]
