"""The second bad-input audit (issue 34): each case gets grpo-lab's sentence (the value, the rule, the fix) before any
work starts, or the behaviour a user expects; a used output_dir, planted links and a really full disk included."""
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from conftest import ROOT, bin_path
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer

TINY = str(tiny_model_path())


def small_args(out, **kw) -> GRPOConfig:
    return GRPOConfig(**{**dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4,
                                max_completion_length=5, learning_rate=1e-3, logging_steps=1, disable_tqdm=True,
                                gradient_checkpointing=False, save_strategy="steps", save_steps=1), **kw})


def small_run(out, model=TINY, callbacks=None, **kw) -> GRPOTrainer:
    return GRPOTrainer(model, exact_answer, args=small_args(out, **kw), train_dataset=arithmetic_task(32),
                       callbacks=callbacks)


def logged_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# --- a second run into a used output_dir ---------------------------------------------------------------------------

def test_a_second_run_into_a_used_folder_is_refused_and_the_first_record_kept(tmp_path):
    small_run(tmp_path, max_steps=2).train()
    record = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"holds a previous run \(checkpoint-1, checkpoint-2, metrics.jsonl \(3 lines\)\)"
                                         r".*resume_from_checkpoint=True.*overwrite_output_dir=True") as e:
        small_run(tmp_path, max_steps=1).train()
    assert str(tmp_path) in str(e.value)
    assert (tmp_path / "metrics.jsonl").read_text() == record                  # run 1's steps are all there
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_overwrite_output_dir_replaces_the_previous_run_so_resume_picks_only_this_runs_checkpoint(tmp_path):
    small_run(tmp_path, max_steps=2).train()
    (tmp_path / "notes.txt").write_text("mine")
    small_run(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]   # run 1's checkpoint-2 is gone
    assert logged_steps(tmp_path) == [1, 1]                                              # the step and the summary
    assert (tmp_path / "notes.txt").read_text() == "mine"                               # other files stay
    resumed = small_run(tmp_path, max_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed._last_checkpoint.name == "checkpoint-2" and logged_steps(tmp_path) == [1, 2, 2]


def test_resuming_in_the_same_folder_continues_its_record(tmp_path):
    small_run(tmp_path, max_steps=2).train()
    small_run(tmp_path, max_steps=3).train(resume_from_checkpoint=True)
    assert logged_steps(tmp_path) == [1, 2, 3, 3]


def test_resuming_a_checkpoint_from_elsewhere_into_a_used_folder_is_refused(tmp_path):
    small_run(tmp_path / "a", max_steps=1).train()
    small_run(tmp_path / "b", max_steps=1).train()
    with pytest.raises(ValueError, match="holds a previous run"):
        small_run(tmp_path / "b", max_steps=2).train(resume_from_checkpoint=tmp_path / "a" / "checkpoint-1")


# --- symbolic links out of output_dir ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["metrics.jsonl", "completions.jsonl", "checkpoint-1", "tmp-checkpoint-1",
                                  "model.safetensors", "README.md"])
def test_a_planted_link_out_of_output_dir_is_refused_before_anything_is_written(tmp_path, name):
    out, victim = tmp_path / "out", tmp_path / "elsewhere" / "victim"
    victim.parent.mkdir()
    victim.write_text("precious") if "checkpoint" not in name else victim.mkdir()
    out.mkdir()
    (out / name).symlink_to(victim)
    trainer = small_run(out, max_steps=1, log_completions=True)
    with pytest.raises(ValueError, match=f"{name} is a symbolic link .* outside output_dir.*Remove the link"):
        trainer.train()
    assert (victim.read_text() == "precious") if victim.is_file() else list(victim.iterdir()) == []
    assert trainer.state.global_step == 0


def test_a_link_planted_during_the_run_is_not_written_through(tmp_path):
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    victim.write_text("precious")

    class PlantLink(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            (out / "metrics.jsonl").unlink(missing_ok=True)
            (out / "metrics.jsonl").symlink_to(victim)

    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        small_run(out, max_steps=2, callbacks=[PlantLink()]).train()
    assert victim.read_text() == "precious"


def test_a_link_that_stays_inside_output_dir_is_followed(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "metrics.jsonl").symlink_to(tmp_path / "logs" / "metrics.jsonl")
    small_run(tmp_path, max_steps=1).train()
    assert logged_steps(tmp_path / "logs") == [1, 1]


# --- export ----------------------------------------------------------------------------------------------------------

def test_export_refuses_more_gpus_than_a_machine_holds(tmp_path):
    r = subprocess.run([bin_path("grpo-lab"), "export", "-c", "configs/tiny-cpu.yaml", "-o", str(tmp_path / "x"),
                        "--gpus", "1000000000000"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "num_processes=1000000000000 on 1 machine" in r.stderr and "--num-machines" in r.stderr
    assert not (tmp_path / "x").exists()
    assert "Traceback" not in r.stderr


# --- config values that TrainingArguments, generation or torch would refuse in their own words -----------------------

@pytest.mark.parametrize("bad, says", [
    (dict(logging_steps=0), "logging_steps=0 with logging_strategy='steps': it must be > 0"),
    (dict(save_steps=0), "save_steps=0 with save_strategy='steps'"),
    (dict(bf16=True, fp16=True), "bf16=True and fp16=True: both mixed-precision modes are set; choose one"),
    (dict(top_k=-1), "top_k=-1 must be >= 0: 0 turns top-k filtering off"),
    (dict(lr_scheduler_type="cosin"), "lr_scheduler_type='cosin' is not a learning-rate schedule (did you mean 'cosine'?)"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1 must be >= 0"),
    (dict(seed="forty-two"), "seed='forty-two' is not a number"),
    (dict(seed=-1), "seed=-1 must be a whole number in [0, 2**32)"),
])
def test_config_values_get_grpo_labs_sentence_first(tmp_path, bad, says):
    with pytest.raises(ValueError) as e:
        GRPOConfig(output_dir=str(tmp_path), **bad)
    assert says in str(e.value), str(e.value)
    assert "IntervalStrategy" not in str(e.value) and "doesn't support" not in str(e.value)


def test_a_seed_given_as_text_trains(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), seed="42", data_seed="7")
    assert (args.seed, args.data_seed) == (42, 7) and isinstance(args.seed, int)
    trainer = small_run(tmp_path, seed="3", max_steps=1, save_strategy="no")
    assert trainer.train().global_step == 1


def test_fp16_on_a_cpu_says_it_trains_in_float32(tmp_path, caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: fp16 runs there")
    with caplog.at_level(logging.WARNING, logger="grpo_lab.assemble"):
        trainer = small_run(tmp_path, fp16=True, max_steps=1, save_strategy="no")
    assert any("fp16=True, but this run is on the CPU" in r.message and "float32" in r.message for r in caplog.records)
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert trainer.train().global_step == 1


# --- model folders ---------------------------------------------------------------------------------------------------

def test_a_truncated_model_safetensors_is_named_before_transformers_reads_it(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is cut short \(.* bytes of the .* its header describes\)"
                                         r".*interrupted"):
        small_run(tmp_path / "out", model=str(folder))
    weights.write_bytes(b"\x07")
    with pytest.raises(ValueError, match="cut short"):
        small_run(tmp_path / "out", model=str(folder))


def test_custom_code_runs_only_with_trust_remote_code(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="my_llama", auto_map={"AutoConfig": "my_llama.MyConfig",
                                                   "AutoModelForCausalLM": "my_llama.MyLlama"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "my_llama.py").write_text(
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class MyConfig(LlamaConfig):\n    model_type = 'my_llama'\n"
        "class MyLlama(LlamaForCausalLM):\n    config_class = MyConfig\n")
    with pytest.raises(ValueError, match="model_type='my_llama', which transformers does not know.*"
                                         r"trust_remote_code=True") as e:
        small_run(tmp_path / "out", model=str(folder))
    assert "hf.co" not in str(e.value)
    trusted = small_run(tmp_path / "out", model=str(folder), trust_remote_code=True)
    assert type(trusted.accelerator.unwrap_model(trusted.model)).__name__ == "MyLlama"


# --- a full disk while saving a checkpoint (a real one: a small tmpfs in a user and mount namespace) -----------------

FULL_DISK_RUN = """
import sys
from pathlib import Path
from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer
out = Path(sys.argv[1])
args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                  logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, save_strategy="steps",
                  save_steps=1, max_steps=3)
trainer = GRPOTrainer(str(tiny_model_path()), exact_answer, args=args, train_dataset=arithmetic_task(32))
try:
    trainer.train()
except OSError as e:
    print("ERROR", e)
print("LEFT", sorted(p.name for p in out.iterdir()))
"""


def _mounts_work(where: Path) -> bool:
    probe = where / "probe"
    probe.mkdir()
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                       capture_output=True, text=True)
    return r.returncode == 0


def test_a_full_disk_during_a_checkpoint_removes_the_partial_folder_and_says_so(tmp_path):
    if shutil.which("unshare") is None or not _mounts_work(tmp_path):
        pytest.skip("no user+mount namespaces here (unshare -rm): cannot mount a small tmpfs without root")
    sizes = tmp_path / "sizes"                          # one checkpoint's files, measured on the real disk
    small_run(sizes, max_steps=1).train()
    files = {p.name: p.stat().st_size for p in (sizes / "checkpoint-1").iterdir()}
    # room for checkpoint-1, then checkpoint-2's weights and half of its optimizer state: torch.save hits the wall
    room = sum(files.values()) + files["model.safetensors"] + files["optimizer.pt"] // 2 + 256 * 1024
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "run.py"
    script.write_text(FULL_DISK_RUN)
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={room} tmpfs {disk} && "
                        f"{sys.executable} {script} {disk}/out"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    error = next(line for line in r.stdout.splitlines() if line.startswith("ERROR"))
    assert "saving checkpoint-2 failed" in error and "the disk is full" in error, error
    assert "the partial tmp-checkpoint-2 was removed" in error and "newest complete checkpoint is checkpoint-1" in error
    assert "resume_from_checkpoint=True" in error
    left = next(line for line in r.stdout.splitlines() if line.startswith("LEFT"))
    assert "'checkpoint-1'" in left and "tmp-checkpoint" not in left and "checkpoint-2" not in left
