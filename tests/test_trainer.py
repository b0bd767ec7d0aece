"""End-to-end GRPO training on CPU with the shipped tiny model: steps, resume, faults, QLoRA, learning."""
import json
import warnings

import pytest
import torch
from datasets import load_dataset

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import RewardFunctionError, exact_answer
from grpo_lab.trainer import NonFiniteLossError, TrainerCallback

TINY = str(tiny_model_path())


def small_args(out, **kw):
    "A fast config: 4 completions per prompt, answers of at most 5 tokens."
    base = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                learning_rate=1e-3, logging_steps=1, disable_tqdm=True, num_train_epochs=1)
    return GRPOConfig(**{**base, **kw})


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def test_trl_quickstart_with_only_the_import_changed(tmp_path):
    "TRL's quick-start: a GRPOConfig, reward_len, a dataset with a prompt column, trainer.train()."
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in arithmetic_task(8)["prompt"]))
    dataset = load_dataset("json", data_files=str(tmp_path / "prompts.jsonl"), split="train")

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                               gradient_accumulation_steps=2, logging_steps=2, disable_tqdm=True)
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
    trainer.train()
    # 8 completions x 2 accumulation = 16 = 2 prompts per step; 8 prompts x 3 epochs (TRL's default)
    assert trainer.global_step == trainer.plan.total_optimizer_steps == 12
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged] == [2, 4, 6, 8, 10, 12]
    assert {"reward", "loss", "rewards/reward_len/mean", "completions/mean_length", "grad_norm"} <= set(logged[-1])
    assert (tmp_path / "out" / "final" / "tokenizer.json").exists()


@pytest.mark.parametrize("kw", [
    dict(gradient_accumulation_steps=2),
    dict(gradient_accumulation_steps=1, steps_per_generation=2),
    dict(num_iterations=2),
    dict(gradient_accumulation_steps=3, num_train_epochs=2),   # last accumulation of each epoch is partial
    dict(max_steps=5, num_train_epochs=1),                     # max_steps runs past one epoch
])
def test_optimizer_steps_equal_the_plan(tmp_path, kw):
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, **kw), train_dataset=arithmetic_task(10))
    calls = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    trainer.train()
    assert len(calls) == trainer.global_step == trainer.plan.total_optimizer_steps


def test_resume_mid_rollout_matches_an_uninterrupted_run(tmp_path):
    "LoRA, two iterations and two optimizer steps per rollout: checkpoint-3 falls inside a rollout."
    kw = dict(lora_r=4, num_iterations=2, steps_per_generation=2, save_steps=1, max_steps=6, learning_rate=5e-3)
    full = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "full", **kw), train_dataset=arithmetic_task(32))
    full.train()
    resumed = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "resumed", **kw), train_dataset=arithmetic_task(32))
    resumed.train(resume_from_checkpoint=tmp_path / "full" / "checkpoint-3")
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert [h["reward"] for h in resumed.history] == [h["reward"] for h in full.history]
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_keyboard_interrupt_saves_and_resume_completes_the_run(tmp_path):
    class Interrupt(TrainerCallback):
        def on_step_end(self, trainer):
            if trainer.global_step == 3:
                raise KeyboardInterrupt

    kw = dict(max_steps=5, save_steps=100)
    reference = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "ref", **kw), train_dataset=arithmetic_task(32))
    reference.train()
    out = tmp_path / "run"
    first = GRPOTrainer(TINY, exact_answer, args=small_args(out, **kw), train_dataset=arithmetic_task(32), callbacks=[Interrupt()])
    first.train()
    assert (out / "checkpoint-3").exists() and not (out / "final").exists()
    second = GRPOTrainer(TINY, exact_answer, args=small_args(out, **kw), train_dataset=arithmetic_task(32))
    second.train(resume_from_checkpoint=True)
    assert second.global_step == 5
    a, b = weights(reference), weights(second)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_raising_reward_function_is_named_with_the_checkpoint_to_resume_from(tmp_path):
    calls = []

    def flaky_reward(prompts, completions, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("answer")
        return [0.0] * len(completions)

    trainer = GRPOTrainer(TINY, flaky_reward, args=small_args(tmp_path, save_steps=1), train_dataset=arithmetic_task(32))
    with pytest.raises(RewardFunctionError) as err:
        trainer.train()
    msg = str(err.value)
    assert "flaky_reward" in msg and "checkpoint-2" in msg


def test_a_reward_function_returning_garbage_is_named(tmp_path):
    def short_reward(prompts, completions, **kw):
        return [1.0]

    trainer = GRPOTrainer(TINY, short_reward, args=small_args(tmp_path), train_dataset=arithmetic_task(16))
    with pytest.raises(RewardFunctionError, match="short_reward"):
        trainer.train()


def test_a_non_finite_loss_stops_before_the_weights_change(tmp_path, monkeypatch):
    import grpo_lab.trainer as tr
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, save_steps=2, max_steps=6), train_dataset=arithmetic_task(32))
    real_loss, snapshot = tr.grpo_loss, {}

    def loss_turning_nan(*a, **k):
        loss, stats = real_loss(*a, **k)
        if trainer.global_step == 2:
            snapshot.update(weights(trainer))
            return loss * float("nan"), stats
        return loss, stats

    monkeypatch.setattr(tr, "grpo_loss", loss_turning_nan)
    with pytest.raises(NonFiniteLossError, match="checkpoint-2"):
        trainer.train()
    after = weights(trainer)
    assert all(torch.equal(snapshot[k], after[k]) for k in after)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_qlora_trains_only_the_adapter_and_final_loads_with_peft(tmp_path):
    from peft import AutoPeftModelForCausalLM
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, load_in_4bit=True, lora_r=8, max_steps=3,
                                                              learning_rate=1e-2), train_dataset=arithmetic_task(32))
    before = weights(trainer)
    trainer.train()
    after = weights(trainer)
    lora = [k for k in after if "lora_" in k]
    base = [k for k in after if "lora_" not in k]
    assert lora and any(not torch.equal(before[k], after[k]) for k in lora)
    assert all(torch.equal(before[k], after[k]) for k in base)
    model = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "final")
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0


def test_full_fine_tuning_with_kl_reports_kl_and_final_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, beta=0.1, max_steps=3), train_dataset=arithmetic_task(32))
    trainer.train()
    assert trainer.history[-1]["kl"] > 0          # the policy moved away from the frozen reference
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tok = AutoTokenizer.from_pretrained(tmp_path / "final")
    assert tok.padding_side == "left" and model.config.vocab_size == len(tok)


def test_dataset_errors_come_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="question"):
        GRPOTrainer("/no/such/model", exact_answer, args=small_args(tmp_path),
                    train_dataset=[{"question": "1+1="}, {"question": "2+2="}])


def test_long_prompts_are_cut_from_the_left_with_one_warning(tmp_path):
    rows = [{"prompt": "0" * 40 + p, "answer": a} for p, a in zip(*arithmetic_task(16)[:].values())]
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_prompt_length=8, max_steps=3), train_dataset=rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    cut = [w for w in caught if "max_prompt_length" in str(w.message)]
    assert len(cut) == 1


def test_a_short_demo_run_improves_held_out_accuracy(tmp_path):
    "GRPO measurably teaches the tiny model: +8 points of greedy accuracy on 300 unseen problems in 50 steps."
    from grpo_lab.cli import run_demo
    summary = run_demo(tmp_path / "demo", steps=50, eval_every=50, quiet=True)
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.08, summary
    assert (tmp_path / "demo" / "curves.png").stat().st_size > 1000
    assert json.loads((tmp_path / "demo" / "summary.json").read_text())["steps"] == 50
