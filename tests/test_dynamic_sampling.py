"""DAPO's dynamic sampling in a run (issue 43): trained batches hold only groups with a spread of rewards, the counts
are logged, the data stream advances past the prompts a step used, resume is exact, and what cannot work is refused."""
import json

import pytest
import torch

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.async_grpo import AsyncGRPOConfig
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer

TINY = str(tiny_model_path())


def args(out, **kw):
    "The tiny model on sums: 4 prompts x 8 completions a step, about half of the groups without a spread at first."
    base = dict(output_dir=str(out), per_device_train_batch_size=32, num_generations=8, max_completion_length=5,
                learning_rate=1e-4, logging_steps=1, disable_tqdm=True, max_steps=4, gradient_checkpointing=False,
                save_strategy="no", report_to="none", seed=0, dynamic_sampling=True, dynamic_sampling_max_rounds=4)
    return GRPOConfig(**{**base, **kw})


class Recording(GRPOTrainer):
    "Records the advantages of every micro-batch the loss learns from (through the public training_step hook)."
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.trained = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.trained.append((inputs.step.batch.group.clone(), inputs.step.batch.advantages.clone()))
        return super().training_step(model, inputs, num_items_in_batch)


def test_trained_batches_hold_only_groups_with_a_spread_and_the_counts_are_logged(tmp_path):
    trainer = Recording(TINY, exact_answer, args=args(tmp_path), train_dataset=arithmetic_task(400, seed=5))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert len(logs) == 4 and sum(h["dynamic_sampling/groups_dropped"] for h in logs) > 0, logs
    assert all(h["dynamic_sampling/groups_short"] == 0 for h in logs), logs
    for groups, advantages in trainer.trained:             # each micro-batch of 32 rows: 4 whole groups
        assert len(advantages) == 32
        for g in groups.unique():
            assert advantages[groups == g].abs().sum() > 0, f"group {int(g)} without a spread reached the loss"
    # the extra rounds read further into the data: 4 steps consumed more than 4 generation batches of prompts
    assert trainer.state.epoch > 4 * 4 / 400, trainer.state.epoch


def test_a_short_batch_is_filled_with_groups_without_a_spread_and_says_so(tmp_path):
    trainer = Recording(TINY, exact_answer, args=args(tmp_path, dynamic_sampling_max_rounds=1, max_steps=2),
                        train_dataset=arithmetic_task(400, seed=5))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dynamic_sampling/rounds" in h]
    assert all(h["dynamic_sampling/rounds"] == 1 for h in logs)
    assert sum(h["dynamic_sampling/groups_short"] for h in logs) == sum(h["dynamic_sampling/groups_dropped"] for h in logs) > 0
    assert all(len(a) == 32 for _, a in trainer.trained)     # the batch keeps its size: the plan's micro-steps stand


def test_resume_reproduces_an_uninterrupted_run_with_dynamic_sampling(tmp_path):
    kw = dict(save_strategy="steps", save_steps=1, max_steps=4)
    full = GRPOTrainer(TINY, exact_answer, args=args(tmp_path / "full", **kw), train_dataset=arithmetic_task(400, seed=5))
    full.train()
    resumed = GRPOTrainer(TINY, exact_answer, args=args(tmp_path / "resumed", **kw),
                          train_dataset=arithmetic_task(400, seed=5))
    resumed.train(resume_from_checkpoint=tmp_path / "full" / "checkpoint-2")
    for key in ("loss", "reward", "dynamic_sampling/rounds", "dynamic_sampling/groups_dropped"):
        assert [h[key] for h in resumed.history] == [h[key] for h in full.history], key
    a = full.accelerator.unwrap_model(full.model).state_dict()
    b = resumed.accelerator.unwrap_model(resumed.model).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert logged[:4] == [1, 2, 3, 4]


def test_what_dynamic_sampling_cannot_do_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds=0"):
        args(tmp_path, dynamic_sampling_max_rounds=0)
    with pytest.raises(ValueError, match="dynamic_sampling=True is not supported by AsyncGRPOTrainer"):
        AsyncGRPOConfig(output_dir=str(tmp_path), dynamic_sampling=True)


def test_off_by_default_as_in_trl(tmp_path):
    plain = GRPOConfig(output_dir=str(tmp_path))
    assert plain.dynamic_sampling is False and plain.dynamic_sampling_max_rounds == 4
    trainer = GRPOTrainer(TINY, exact_answer, args=args(tmp_path, dynamic_sampling=False, max_steps=1),
                          train_dataset=arithmetic_task(400, seed=5))
    trainer.train()
    assert not any(k.startswith("dynamic_sampling/") for h in trainer.state.log_history for k in h)
