"""End-to-end GRPO training on CPU with the shipped tiny model: steps, resume, faults, callbacks, QLoRA, learning."""
import json
import logging
import math

import pytest
import torch
from datasets import load_dataset
from transformers import AutoTokenizer, EarlyStoppingCallback, TrainerCallback

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import RewardFunctionError, exact_answer
from grpo_lab.steps import generation_rows
import grpo_lab.trainer as tr
from grpo_lab.trainer import NonFiniteLossError, TrainingInterrupted

TINY = str(tiny_model_path())


def small_args(out, **kw):
    "A fast config: 4 completions per prompt, answers of at most 5 tokens, no gradient checkpointing."
    base = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                learning_rate=1e-3, logging_steps=1, disable_tqdm=True, num_train_epochs=1,
                gradient_checkpointing=False, save_strategy="no")
    return GRPOConfig(**{**base, **kw})


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_trl_quickstart_as_people_write_it(tmp_path):
    "TRL's quick-start with only the import changed, and its reward without **kwargs."
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in arithmetic_task(8)["prompt"]))
    dataset = load_dataset("json", data_files=str(tmp_path / "prompts.jsonl"), split="train")

    def reward_len(prompts, completions):
        return [len(c) for c in completions]

    training_args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8,
                               gradient_accumulation_steps=2, logging_steps=2, disable_tqdm=True, max_completion_length=8)
    trainer = GRPOTrainer(model=TINY, reward_funcs=reward_len, args=training_args, train_dataset=dataset)
    output = trainer.train()
    # 8 completions x 2 accumulation = 16 = 2 prompts per step; 8 prompts x 3 epochs (TRL's default)
    assert output.global_step == trainer.state.global_step == trainer.plan.total_optimizer_steps == 12
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged] == [2, 4, 6, 8, 10, 12, 12]          # the steps, then the run's summary
    assert [h["step"] for h in trainer.state.log_history] == [2, 4, 6, 8, 10, 12, 12]
    assert [h["step"] for h in trainer.history] == [2, 4, 6, 8, 10, 12]
    logged = logged[:-1]
    trl_keys = {"loss", "grad_norm", "learning_rate", "epoch", "reward", "reward_std", "frac_reward_zero_std",
                "rewards/reward_len/mean", "rewards/reward_len/std", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                "completions/min_terminated_length", "completions/max_terminated_length", "entropy",
                "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                "clip_ratio/region_mean"}
    assert trl_keys <= set(logged[-1]), trl_keys - set(logged[-1])
    assert logged[-1]["epoch"] == 3.0
    assert not (tmp_path / "out" / "model.safetensors").exists()      # train() saves no final model, as in TRL
    trainer.save_model()
    assert (tmp_path / "out" / "tokenizer.json").exists() and (tmp_path / "out" / "model.safetensors").exists()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "- trl" in card and "- grpo" in card


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
    assert len(calls) == trainer.state.global_step == trainer.plan.total_optimizer_steps


def test_resume_mid_rollout_matches_an_uninterrupted_run(tmp_path):
    "LoRA, two iterations and two optimizer steps per rollout: checkpoint-3 falls inside a rollout."
    kw = dict(num_iterations=2, steps_per_generation=2, save_strategy="steps", save_steps=1, max_steps=6,
              learning_rate=5e-3)
    full = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "full", **kw), train_dataset=arithmetic_task(32),
                       lora_r=4)
    full.train()
    resumed = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "resumed", **kw), train_dataset=arithmetic_task(32),
                          lora_r=4)
    resumed.train(resume_from_checkpoint=tmp_path / "full" / "checkpoint-3")
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert [h["reward"] for h in resumed.history] == [h["reward"] for h in full.history]
    assert same_weights(weights(full), weights(resumed))
    logged = [json.loads(l)["step"] for l in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6, 6]         # the resumed history, then the new steps, no repeats, the summary


def test_keyboard_interrupt_saves_and_resume_completes_the_run(tmp_path):
    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt

    kw = dict(max_steps=5)
    reference = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "ref", **kw), train_dataset=arithmetic_task(32))
    reference.train()
    out = tmp_path / "run"
    first = GRPOTrainer(TINY, exact_answer, args=small_args(out, **kw), train_dataset=arithmetic_task(32), callbacks=[Interrupt()])
    with pytest.raises(TrainingInterrupted) as stop:
        first.train()
    assert stop.value.step == 3 and stop.value.checkpoint == out / "checkpoint-3" and "checkpoint-3" in str(stop.value)
    assert (out / "checkpoint-3").exists() and not (out / "model.safetensors").exists()
    second = GRPOTrainer(TINY, exact_answer, args=small_args(out, **kw), train_dataset=arithmetic_task(32))
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 5
    assert same_weights(weights(reference), weights(second))


def test_a_callback_can_stop_training_and_early_stopping_works_with_evaluation(tmp_path):
    args = small_args(tmp_path, max_steps=20, eval_strategy="steps", eval_steps=1, metric_for_best_model="reward",
                      save_strategy="steps", save_steps=1, load_best_model_at_end=True, per_device_eval_batch_size=8)
    stopper = EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=10.0)  # nothing improves by 10
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(64),
                          eval_dataset=arithmetic_task(4, seed=1), callbacks=[stopper])
    trainer.train()
    assert trainer.state.global_step == 3           # best at step 1, then two evaluations without improvement
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [1, 2, 3]
    assert trainer.state.best_metric == max(h["eval_reward"] for h in evals)
    assert {"eval_rewards/exact_answer/mean", "eval_completions/mean_length"} <= set(evals[0])


def test_reward_function_arguments_as_in_trl(tmp_path):
    seen = {}

    def reward_with_state(prompts, completions, completion_ids, answer, trainer_state, log_metric, log_extra):
        seen["step"] = trainer_state.global_step
        log_metric("my_metric", 0.5)
        log_extra("note", ["x"] * len(completions))
        return [float(len(ids)) for ids in completion_ids]

    async def async_reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(TINY, [reward_with_state, async_reward], args=small_args(tmp_path, max_steps=2),
                          train_dataset=arithmetic_task(16))
    trainer.train()
    assert seen["step"] == 1 and trainer.history[-1]["my_metric"] == 0.5
    assert "rewards/async_reward/mean" in trainer.history[-1]


def test_a_raising_reward_function_is_named_with_the_checkpoint_to_resume_from(tmp_path):
    calls = []

    def flaky_reward(prompts, completions, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("answer")
        return [0.0] * len(completions)

    trainer = GRPOTrainer(TINY, flaky_reward, args=small_args(tmp_path, save_strategy="steps", save_steps=1),
                          train_dataset=arithmetic_task(32))
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
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, save_strategy="steps", save_steps=2, max_steps=6),
                          train_dataset=arithmetic_task(32))
    real_loss, snapshot = tr.grpo_loss, {}

    def loss_turning_nan(*a, **k):
        loss, stats = real_loss(*a, **k)
        if trainer.state.global_step == 2:
            snapshot.update(weights(trainer))
            return loss * float("nan"), stats
        return loss, stats

    monkeypatch.setattr(tr, "grpo_loss", loss_turning_nan)
    with pytest.raises(NonFiniteLossError, match="checkpoint-2"):
        trainer.train()
    assert same_weights(snapshot, weights(trainer))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


@pytest.mark.parametrize("no_clip", [0.0, -1.0, None])
def test_max_grad_norm_zero_negative_or_none_means_no_clipping(tmp_path, no_clip):
    "The HF Trainer's meaning: the same update as an unreachable clip threshold (before: frozen or reversed)."
    runs = {}
    for name, value in (("none", no_clip), ("huge", 1e9)):
        t = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / name, max_grad_norm=value, max_steps=2),
                        train_dataset=arithmetic_task(16))
        t.train()
        runs[name] = weights(t)
    assert same_weights(runs["none"], runs["huge"])


def test_logged_dapo_loss_does_not_depend_on_accumulation(tmp_path):
    "The same 16 completions as one micro-batch or two: dapo's step loss is the sum of the micro-batch losses."
    def length(prompts, completions, **kw):            # rewards that differ with length: a non-zero loss value
        return [float(len(c)) for c in completions]

    losses = []
    for pd, ga in ((16, 1), (8, 2)):
        t = GRPOTrainer(TINY, length, args=small_args(tmp_path / f"{pd}", per_device_train_batch_size=pd,
                                                      gradient_accumulation_steps=ga, max_steps=1, max_completion_length=8, temperature=3.0,
                                                      loss_type="dapo"), train_dataset=arithmetic_task(16))
        t.train()
        losses.append(t.history[-1]["loss"])
    assert losses[0] != 0 and math.isclose(losses[0], losses[1], rel_tol=1e-4, abs_tol=1e-6), losses


def test_mask_truncated_completions_hides_them_from_the_loss_not_from_the_rewards(tmp_path):
    seen = []

    def record(prompts, completions, **kw):
        seen.extend(completions)
        return [0.0] * len(completions)

    t = GRPOTrainer(TINY, record, args=small_args(tmp_path, mask_truncated_completions=True, max_completion_length=2,
                                                  max_steps=1), train_dataset=arithmetic_task(16))
    t.train()
    assert all(len(c) > 0 for c in seen) and t.history[-1]["completions/mean_length"] > 0


def test_qlora_trains_only_the_adapter_and_the_saved_model_loads_with_peft(tmp_path):
    from peft import AutoPeftModelForCausalLM
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=3, learning_rate=1e-2,
                                                              save_strategy="steps"),
                          train_dataset=arithmetic_task(32), load_in_4bit=True, lora_r=8)
    before = weights(trainer)
    trainer.train()
    after = weights(trainer)
    lora = [k for k in after if "lora_" in k]
    base = [k for k in after if "lora_" not in k]
    assert lora and any(not torch.equal(before[k], after[k]) for k in lora)
    assert all(torch.equal(before[k], after[k]) for k in base)
    trainer.save_model()                      # train() saves no final model (as TRL): the script asks for it
    model = AutoPeftModelForCausalLM.from_pretrained(tmp_path)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) > 0


def test_peft_config_and_a_peft_model_are_accepted(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    by_config = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "a", max_steps=1), train_dataset=arithmetic_task(16),
                            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    by_config.train()
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY), LoraConfig(r=4, target_modules=["q_proj"]))
    by_model = GRPOTrainer(peft_model, exact_answer, args=small_args(tmp_path / "b", max_steps=1),
                           train_dataset=arithmetic_task(16))
    by_model.train()
    assert any("lora_" in k for k in weights(by_model)) and any("lora_" in k for k in weights(by_config))


def test_full_fine_tuning_with_kl_reports_kl_and_the_saved_model_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, beta=0.1, max_steps=3, save_strategy="steps"),
                          train_dataset=arithmetic_task(32))
    trainer.train()
    assert trainer.history[-1]["kl"] > 0          # the policy moved away from the frozen reference
    trainer.save_model()
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.padding_side == "left" and model.config.vocab_size == len(tok)


def test_save_strategy_no_writes_no_model(tmp_path):
    GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=2), train_dataset=arithmetic_task(16)).train()
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("checkpoint-*"))


def test_dataset_errors_come_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="question"):
        GRPOTrainer("/no/such/model", exact_answer, args=small_args(tmp_path),
                    train_dataset=[{"question": "1+1="}, {"question": "2+2="}])


def test_output_dir_that_is_a_file_fails_at_construction(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "file"), train_dataset=arithmetic_task(16))


def test_long_prompts_are_cut_from_the_left_with_one_warning_per_batch(tmp_path, caplog):
    rows = [{"prompt": "0" * 40 + p, "answer": a} for p, a in zip(*arithmetic_task(16)[:].values())]
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_prompt_length=8, max_steps=1), train_dataset=rows)
    with caplog.at_level(logging.WARNING, logger="grpo_lab.rollout"):
        trainer.train()
    assert any("max_prompt_length=8" in r.message for r in caplog.records)


def test_tensorboard_receives_the_logs(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=2, report_to="tensorboard"),
                          train_dataset=arithmetic_task(16))
    trainer.train()
    events = list(tmp_path.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent)).Reload()
    tags = acc.Tags()["scalars"]
    assert "train/reward" in tags and [e.step for e in acc.Scalars("train/reward")] == [1, 2]


def test_a_short_demo_run_improves_held_out_accuracy(tmp_path):
    "GRPO measurably teaches the tiny model: +6 points of greedy accuracy on 300 unseen problems in 100 steps (measured +10.7)."
    from grpo_lab.cli import run_demo
    summary = run_demo(tmp_path / "demo", steps=100, eval_size=300, eval_every=100, quiet=True)
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.06, summary
    assert (tmp_path / "demo" / "curves.png").stat().st_size > 1000
    assert json.loads((tmp_path / "demo" / "summary.json").read_text())["steps"] == 100


def test_prompts_longer_than_the_models_context_are_refused_before_training(tmp_path):
    rows = [{"prompt": "1" * 100, "answer": "1"}] + arithmetic_task(15).to_list()
    with pytest.raises(ValueError, match=r"prompt 0 has 100 tokens but the model reads at most 64 positions"):
        GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path), train_dataset=rows)


def test_completions_that_cannot_fit_are_announced_once_and_capped(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_lab.assemble"):
        trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_completion_length=512),
                              train_dataset=arithmetic_task(16))
    assert sum("max_completion_length=512 does not fit" in r.message for r in caplog.records) == 1
    assert trainer.max_new_tokens < 64


def test_a_trl_style_script_with_a_reward_model_by_path_and_a_function(tmp_path):
    "reward_funcs mixes a sequence-classification reward model (a folder) and a function, as TRL allows."
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from grpo_lab.models import tiny_tokenizer
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    folder = tmp_path / "tiny-reward-model"
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    trainer = GRPOTrainer(TINY, [str(folder), exact_answer], args=small_args(tmp_path / "out", max_steps=2,
                                                                           reward_weights=[0.5, 1.0]),
                          train_dataset=arithmetic_task(16))
    trainer.train()
    logged = trainer.history[-1]
    assert {"rewards/tiny-reward-model/mean", "rewards/exact_answer/mean"} <= set(logged)
    assert logged["rewards/tiny-reward-model/std"] > 0          # the model scores completions differently


def test_adaptive_entropy_rule_by_hand():
    "TRL's rule: +delta at or below the target, -delta above, clamped; the bonus applies after a step at or below."
    from grpo_lab.trainer import AdaptiveEntropy
    control = AdaptiveEntropy(coef=0.01, target=0.5, delta=0.004, coef_min=0.002, coef_max=0.016)
    assert control.applied() == 0.0                       # no entropy measured yet: no bonus in the first step
    assert control.update(0.5) == pytest.approx(0.014) and control.applied() == pytest.approx(0.014)
    assert control.update(0.1) == pytest.approx(0.016)    # 0.018 clamped to coef_max
    assert control.update(0.6) == pytest.approx(0.012) and control.applied() == 0.0
    for _ in range(5):
        control.update(2.0)
    assert control.coef == pytest.approx(0.002)           # clamped to coef_min


@pytest.mark.parametrize("target,direction", [(5.0, +1), (0.01, -1)])
def test_adaptive_entropy_coefficient_follows_the_measured_entropy(tmp_path, target, direction):
    "The tiny model's entropy is ~0.5-0.9 nats: a target above it raises the coefficient each step, below lowers it."
    args = small_args(tmp_path, max_steps=4, use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.02,
                      entropy_coef_min=0.0, entropy_coef_max=0.1, entropy_target=target, gradient_accumulation_steps=2)
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32))
    trainer.train()
    coefs = [h["entropy_coef"] for h in trainer.history]
    expected = [min(max(0.05 + direction * 0.02 * k, 0.0), 0.1) for k in range(1, 5)]
    assert coefs == pytest.approx(expected)
    assert all("policy_loss" in h for h in trainer.history)


def test_adaptive_entropy_state_survives_resume(tmp_path):
    kw = dict(max_steps=5, use_adaptive_entropy=True, entropy_coef=0.05, entropy_coef_delta=0.02, entropy_target=5.0,
              save_strategy="steps", save_steps=1)
    full = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "full", **kw), train_dataset=arithmetic_task(32))
    full.train()
    saved = json.loads((tmp_path / "full" / "checkpoint-2" / "grpo_lab_state.json").read_text())["entropy_control"]
    assert saved["coef"] == pytest.approx(0.09) and saved["last_entropy"] < 5.0
    resumed = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "resumed", **kw), train_dataset=arithmetic_task(32))
    resumed.train(resume_from_checkpoint=tmp_path / "full" / "checkpoint-2")
    assert [h["entropy_coef"] for h in resumed.history] == [h["entropy_coef"] for h in full.history]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert same_weights(weights(full), weights(resumed))


def test_a_fixed_entropy_coef_is_applied_every_step_and_logged_as_trl_logs_it(tmp_path):
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=2, entropy_coef=0.1),
                          train_dataset=arithmetic_task(16))
    trainer.train()
    for h in trainer.history:
        assert h["entropy_coef"] == 0.1
        assert h["loss"] == pytest.approx(h["policy_loss"] - 0.1 * h["entropy"], abs=1e-5)


# --- generation: one prefill per prompt, its cache shared by the prompt's G completions ---

def _random_qwen(vocab: int, seed: int = 0):
    "A 2-layer random-weight Qwen2 (sliding-window layer types included): completions that never stop early."
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def _grouped_prompts(tok, G=4):
    from grpo_lab.rollout import tokenize_prompts
    return tokenize_prompts(tok, [p for p in ["12+7=", "3+45=", "100+200=", "9="] for _ in range(G)])[:2]


def _sample(model, tok, ids, mask, config, share, seed=0):
    from grpo_lab.rollout import sample_completions
    torch.manual_seed(seed)
    return sample_completions(model, ids, mask, config, [], share_prefill=share)[0]


@pytest.mark.parametrize("settings", [dict(do_sample=False), dict(do_sample=True),
                                      dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.01,
                                           repetition_penalty=1.3)])
def test_shared_prefill_samples_what_plain_generate_samples(settings):
    "Same seed, same completions (greedy and sampled, with every sampling knob), left-padded prompts of 4 lengths."
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tok = AutoTokenizer.from_pretrained(TINY)
    ids, mask = _grouped_prompts(tok)
    assert (mask == 0).any()                                           # some rows are padded
    for model in (AutoModelForCausalLM.from_pretrained(TINY).eval(), _random_qwen(len(tok))):
        config = GenerationConfig(max_new_tokens=12, pad_token_id=tok.pad_token_id, eos_token_id=[], **settings)
        plain, shared = _sample(model, tok, ids, mask, config, False), _sample(model, tok, ids, mask, config, True)
        assert plain.shape == (16, 12) and torch.equal(plain, shared)
        if settings["do_sample"]:
            assert len({tuple(r) for r in shared[:4].tolist()}) > 1       # still G different samples per prompt


def test_shared_prefill_logits_match_plain_generate():
    "Step by step, the logits of generate from the shared cache equal plain generate's within float tolerance."
    from transformers import AutoTokenizer, GenerationConfig
    from grpo_lab.rollout import prefill_once_per_prompt
    tok = AutoTokenizer.from_pretrained(TINY)
    ids, mask = _grouped_prompts(tok)
    model = _random_qwen(len(tok))
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id, eos_token_id=[],
                              output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        shared = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                cache=prefill_once_per_prompt(model, ids, mask))
    assert torch.equal(plain.sequences, shared.sequences)
    for a, b in zip(plain.logits, shared.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_shared_prefill_uses_the_cache_argument_with_no_deprecation_warning():
    "transformers renamed `past_key_values` to `cache` (the old name warns, removed in 5.40): the prefill uses `cache`."
    import warnings
    import peft
    from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
    tok = AutoTokenizer.from_pretrained(TINY)
    ids, mask = _grouped_prompts(tok)
    model = AutoModelForCausalLM.from_pretrained(TINY)
    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(TINY), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    config = GenerationConfig(do_sample=True, max_new_tokens=3, pad_token_id=tok.pad_token_id, eos_token_id=[])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*deprecated", category=FutureWarning)
        with pytest.raises(FutureWarning):           # the filter catches the old spelling ...
            model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config))
        for policy in (model, lora):                # ... and the shared prefill does not use it
            assert _sample(policy, tok, ids, mask, config, True).shape == (16, 3)


def test_shared_prefill_reads_each_prompt_once():
    "The prefill forward sees the unique prompts only (4 rows for 16 completions); generate then feeds 1 token a row."
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tok = AutoTokenizer.from_pretrained(TINY)
    ids, mask = _grouped_prompts(tok)
    model = AutoModelForCausalLM.from_pretrained(TINY).train()
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, inp, out: shapes.append(tuple(inp[0].shape)))
    config = GenerationConfig(do_sample=True, max_new_tokens=3, pad_token_id=tok.pad_token_id, eos_token_id=[])
    _sample(model, tok, ids, mask, config, True)
    hook.remove()
    assert shapes[0] == (4, ids.size(1) - 1) and all(s == (16, 1) for s in shapes[1:]), shapes
    assert model.training                                               # the caller's mode is restored


def test_shared_prefill_falls_back_to_plain_generate():
    "No repeated row, a static cache or beam search: plain generate (no shared cache is built)."
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from grpo_lab.rollout import _can_share_prefill, prefill_once_per_prompt, prompt_groups, tokenize_prompts
    tok = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY)
    ids, mask, _ = tokenize_prompts(tok, ["1+1=", "2+2=", "1+1="])
    assert prompt_groups(ids, mask).tolist() == [0, 1, 2]            # only consecutive copies form a group
    assert prefill_once_per_prompt(model, ids, mask) is None
    base = dict(do_sample=True, max_new_tokens=3, pad_token_id=tok.pad_token_id)
    assert _can_share_prefill(model, GenerationConfig(**base), ids)
    assert not _can_share_prefill(model, GenerationConfig(**base, cache_implementation="static"), ids)
    assert not _can_share_prefill(model, GenerationConfig(**base, num_beams=2), ids)
    assert not _can_share_prefill(model, GenerationConfig(**base, use_cache=False), ids)


def test_trainer_rollout_same_with_and_without_shared_prefill(tmp_path, monkeypatch):
    "The trainer's engine (LoRA model, G=4) draws the same completions whether the prefill is shared or not."
    import grpo_lab.rollout as rollout_module
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, seed=3, max_completion_length=8),
                          train_dataset=arithmetic_task(8, seed=1), lora_r=4, lora_alpha=8)
    rows, group = generation_rows(trainer.train_dataset.select([0, 1]).to_list(), 4)
    monkeypatch.setitem(rollout_module.SHARED_PREFILL_MIN_FLOPS, "cpu", 0)   # the tiny model is below the default
    calls = []
    real = rollout_module.prefill_once_per_prompt
    monkeypatch.setattr(rollout_module, "prefill_once_per_prompt", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(0)
    shared = tr._completions(trainer, rows, group).completion_ids
    monkeypatch.setattr(rollout_module, "prefill_once_per_prompt", lambda *a: None)
    torch.manual_seed(0)
    plain = tr._completions(trainer, rows, group).completion_ids
    assert calls and torch.equal(shared, plain)


def test_shared_prefill_by_default_only_where_it_saves_enough(monkeypatch):
    "share_prefill=None: plain generate for the tiny model's small prompts, shared once the saving passes the bar."
    import grpo_lab.rollout as rollout_module
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tok = AutoTokenizer.from_pretrained(TINY)
    ids, mask = _grouped_prompts(tok)
    model = AutoModelForCausalLM.from_pretrained(TINY)
    saving = rollout_module.prefill_saving(model, ids, mask)
    assert saving == 2 * model.num_parameters(exclude_embeddings=True) * 12 * (ids.size(1) - 1)   # 12 rows not re-read
    config = GenerationConfig(do_sample=True, max_new_tokens=2, pad_token_id=tok.pad_token_id, eos_token_id=[])
    calls = []
    monkeypatch.setattr(rollout_module, "prefill_once_per_prompt", lambda *a: calls.append(1))
    rollout_module.sample_completions(model, ids, mask, config, [])
    assert calls == [] and saving < rollout_module.SHARED_PREFILL_MIN_FLOPS["cpu"]
    monkeypatch.setitem(rollout_module.SHARED_PREFILL_MIN_FLOPS, "cpu", saving)
    rollout_module.sample_completions(model, ids, mask, config, [])
    assert calls == [1]


def test_generate_renders_and_tokenizes_each_prompt_once(tmp_path, monkeypatch):
    "A group's G copies of a prompt are rendered and tokenized once; the texts and tensors are those of every row."
    import grpo_lab.rollout as rollout_module
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path), train_dataset=arithmetic_task(8, seed=1))
    rows, group = generation_rows(trainer.train_dataset.select([0, 1]).to_list(), 4)
    rendered, real_render = [], rollout_module.render_prompt
    monkeypatch.setattr(rollout_module, "render_prompt", lambda p, *a, **k: rendered.append(p) or real_render(p, *a, **k))
    tokenized, tok = [], trainer.processing_class
    real_call = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, text, *a, **k: tokenized.append(text) or real_call(self, text, *a, **k))
    out = tr._completions(trainer, rows, group)
    texts, p_ids, p_mask = out.prompt_texts, out.prompt_ids, out.prompt_mask
    assert len(rendered) == 2 and len(tokenized) == 2
    assert texts == [real_render(r["prompt"], tok) for r in rows] and p_ids.size(0) == 8
    assert torch.equal(p_ids[:4], p_ids[0].expand(4, -1)) and not torch.equal(p_ids[0], p_ids[4])


def test_the_last_log_entry_is_the_hf_summary_with_the_unlogged_steps_metrics(tmp_path):
    "HF Trainer's closing entry (train_runtime ... train_loss), plus TRL's flush of the metrics not yet logged."
    args = small_args(tmp_path / "out", max_steps=5, logging_steps=2, entropy_coef=0.01)
    trainer = GRPOTrainer(model=TINY, reward_funcs=exact_answer, args=args, train_dataset=arithmetic_task(16))
    out = trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [2, 4]                   # step 5 is not forced into a log of its own
    last = trainer.state.log_history[-1]
    for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss", "epoch"):
        assert key in last and key in out.metrics, key
    assert last["step"] == 5 and "loss" not in last and "grad_norm" not in last
    assert last["rewards/exact_answer/mean"] is not None and last["entropy_coef"] == 0.01 and "policy_loss" in last
    assert out.training_loss == pytest.approx(last["train_loss"])
    assert trainer.history[-1]["step"] == 4


def test_trl_attributes_entropy_coef_reward_processing_classes_logs_and_aux_loss(tmp_path):
    "The attributes TRL's users and tests read: entropy_coef, reward_processing_classes, _logs, aux_loss_enabled."
    def tagged(completions, log_extra, **kwargs):
        log_extra("head", [c[:3] for c in completions])
        return [float(len(c)) for c in completions]

    args = small_args(tmp_path / "out", max_steps=2, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=50.0)
    trainer = GRPOTrainer(model=TINY, reward_funcs=[tagged, exact_answer], args=args, train_dataset=arithmetic_task(16))
    assert trainer.reward_processing_classes == [None, None] and trainer.aux_loss_enabled is False
    assert trainer.entropy_coef == 0.01
    trainer.train()
    assert trainer.entropy_coef > 0.01                  # entropy below the target: the coefficient went up each step
    logs = trainer._logs
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == trainer.plan.generation_batch_size
    assert set(logs["rewards"]) == {"tagged", "exact_answer"} and "head" in logs["extra"]
    assert list(logs["extra"]["head"]) == [c[:3] for c in logs["completion"]]
    static = GRPOTrainer(model=TINY, reward_funcs=exact_answer, args=small_args(tmp_path / "o2", entropy_coef=0.2),
                         train_dataset=arithmetic_task(16))
    assert static.entropy_coef == 0.2


def test_trl_construction_errors_and_a_single_reward_processing_class(tmp_path):
    "TRL's wording for a missing reward or dataset; one processing class is a list of one; a mismatch names both counts."
    from transformers import AutoTokenizer
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(model=TINY, args=small_args(tmp_path / "a"), train_dataset=arithmetic_task(8))
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        GRPOTrainer(model=TINY, reward_funcs=exact_answer, args=small_args(tmp_path / "b"))
    tok = AutoTokenizer.from_pretrained(TINY)
    with pytest.raises(ValueError, match=r"\(1\) must match the number of reward_funcs \(2\)"):
        GRPOTrainer(model=TINY, reward_funcs=[exact_answer, exact_answer], reward_processing_classes=tok,
                    args=small_args(tmp_path / "c"), train_dataset=arithmetic_task(8))
    trainer = GRPOTrainer(model=TINY, reward_funcs=exact_answer, reward_processing_classes=tok,
                          args=small_args(tmp_path / "d"), train_dataset=arithmetic_task(8))
    assert trainer.reward_processing_classes == [None]          # a plain function keeps no tokenizer


def test_get_high_entropy_mask_is_a_method_that_gathers_over_processes(tmp_path):
    class TwoProcesses:       # this process has 2 tokens, the other 3 (padded with -1 to the same length)
        def pad_across_processes(self, t, dim, pad_index):
            return torch.cat([t, torch.full((3 - len(t),), pad_index)])

        def gather(self, t):
            return torch.cat([t, torch.tensor([0.2, 0.4, 0.6])])

    probe = GRPOTrainer.__new__(GRPOTrainer)
    probe.accelerator = TwoProcesses()
    mask = probe.get_high_entropy_mask(torch.tensor([[0.1, 0.5, 9.0]]), torch.tensor([[1, 1, 0]]), threshold=0.5)
    assert mask.tolist() == [[False, True, False]]     # median of 0.1 0.5 0.2 0.4 0.6 is 0.4; padding is never counted


def test_sequence_level_ratio_with_a_token_summed_loss_warns(tmp_path, caplog):
    for loss_type, warns in (("dapo", True), ("grpo", False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            GRPOTrainer(model=TINY, reward_funcs=exact_answer, train_dataset=arithmetic_task(8),
                        args=small_args(tmp_path / loss_type, importance_sampling_level="sequence", loss_type=loss_type))
        assert ("weights each sequence by its completion length" in caplog.text) == warns


def test_eval_dataset_dict_is_evaluated_per_set_with_an_eval_loss(tmp_path):
    "A dict of eval sets: each evaluated on its own (eval_<name>_*), with eval_loss; trainer.eval_dataset is what was given."
    from datasets import DatasetDict
    sets = DatasetDict({"easy": arithmetic_task(2, seed=1), "hard": arithmetic_task(2, seed=2)})
    trainer = GRPOTrainer(model=TINY, reward_funcs=exact_answer, args=small_args(tmp_path / "out", max_steps=1),
                          train_dataset=arithmetic_task(8), eval_dataset=sets)
    assert trainer.eval_dataset is sets
    metrics = trainer.evaluate()
    for name in ("easy", "hard"):
        assert math.isfinite(metrics[f"eval_{name}_loss"]) and f"eval_{name}_reward" in metrics
    single = trainer.evaluate(eval_dataset=arithmetic_task(2, seed=3))
    assert math.isfinite(single["eval_loss"]) and "eval_reward" in single
    assert trainer.state.log_history[-1] == {**single, "epoch": 0.0, "step": 0}


def test_a_streamed_train_set_sets_dispatch_batches_false_and_no_workers(tmp_path, caplog):
    from datasets import IterableDataset
    stream = lambda: IterableDataset.from_generator(lambda: iter(arithmetic_task(8)))
    with caplog.at_level(logging.WARNING):
        trainer = GRPOTrainer(model=TINY, reward_funcs=exact_answer, train_dataset=stream(),
                              args=small_args(tmp_path / "a", max_steps=1, dataloader_num_workers=2))
    assert trainer.args.accelerator_config.dispatch_batches is False and trainer.args.dataloader_num_workers == 0
    assert "dataloader_num_workers=2 is set to 0" in caplog.text
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(model=TINY, reward_funcs=exact_answer, train_dataset=stream(),
                    args=small_args(tmp_path / "b", max_steps=1, accelerator_config={"dispatch_batches": True}))


def test_continuous_batching_is_an_engine_behind_trls_switch(tmp_path):
    "TRL's switch (and its deprecated name) picks transformers' continuous batching; a step trains on what it sampled."
    from grpo_lab.rollout import ContinuousBatchingEngine
    paged = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "paged", use_transformers_paged=True),
                        train_dataset=arithmetic_task(16))
    assert isinstance(paged.engine, ContinuousBatchingEngine)
    trainer = GRPOTrainer(TINY, exact_answer, train_dataset=arithmetic_task(16),
                          args=small_args(tmp_path, max_steps=1, use_transformers_continuous_batching=True))
    assert isinstance(trainer.engine, ContinuousBatchingEngine)
    rows = arithmetic_task(4).to_list()
    group = torch.arange(4).repeat_interleave(2)
    out = trainer.engine.generate([r for r in rows for _ in range(2)], group, trainer.model, trainer.sampling, 0)
    assert out.completion_ids.shape[0] == 8 and out.completion_ids.shape[1] <= trainer.sampling.max_new_tokens
    lengths = out.completion_mask.sum(1)
    assert (lengths >= 1).all() and ((lengths == out.completion_ids.shape[1]) | ~out.truncated).all()
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"]) and trainer.state.global_step == 1


def test_prompt_rows_come_as_python_values_whatever_the_dataset_format(tmp_path):
    "Each generation batch's rows are the shuffled chunks of the dataset, as plain Python, even with a numpy format."
    from grpo_lab.steps import generation_chunks
    data = arithmetic_task(16, seed=3)
    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path), train_dataset=data.with_format("numpy"))
    batches = [rows for rows, _ in tr._epoch_chunks(trainer, epoch=1, start=0)]
    chunks = generation_chunks(len(data), trainer.plan.unique_prompts_per_generation, 42, 1, shuffle=True)
    assert batches == [data.select(c).to_list() for c in chunks]
    assert all(type(row["answer"]) is str and type(row["prompt"]) is str for rows in batches for row in rows)


def test_callbacks_see_clipped_gradients_before_the_optimizer_step(tmp_path):
    "As in the HF Trainer: gradients are clipped first, then on_pre_optimizer_step fires (found by the parity test)."
    from transformers import TrainerCallback
    norms = []

    class GradNorm(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            grads = [p.grad.norm() for p in model.parameters() if p.grad is not None]
            norms.append(torch.stack(grads).norm().item())

    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=3, max_grad_norm=1e-3, learning_rate=1e-3),
                          train_dataset=arithmetic_task(32), callbacks=[GradNorm()])
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.history if "grad_norm" in h]
    assert len(norms) == 3 and max(norms) <= 1e-3 * 1.001, norms
    assert any(g > 1e-3 for g in logged), logged          # the logged norm is the one before clipping, as HF logs it


def test_each_generation_falls_inside_its_steps_callbacks_as_in_hf_and_trl(tmp_path, monkeypatch):
    "on_step_begin comes before the step's rollout is sampled, so a callback timing a step times its generation."
    events = []
    completions = tr._completions
    monkeypatch.setattr(tr, "_completions", lambda *a, **k: events.append("generate") or completions(*a, **k))

    class Order(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            events.append("begin")

        def on_step_end(self, args, state, control, **kwargs):
            events.append("end")

    trainer = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=3, num_iterations=2),
                          train_dataset=arithmetic_task(16), callbacks=[Order()])
    trainer.train()
    # mu=2: a rollout serves two steps, so the second step of each pair generates nothing
    assert events == ["begin", "generate", "end", "begin", "end", "begin", "generate", "end"]


def test_training_step_is_called_per_micro_batch_with_the_generation_batchs_rows(tmp_path, monkeypatch):
    "HF's hook, as TRL calls it: once per micro-batch, with this process's rows (each prompt G times), the loss back."
    calls = []
    step = tr.GRPOTrainer.training_step

    def spy(self, model, inputs, num_items_in_batch=None):
        loss = step(self, model, inputs, num_items_in_batch)
        calls.append(([r["prompt"] for r in inputs], loss))
        return loss

    monkeypatch.setattr(tr.GRPOTrainer, "training_step", spy)
    args = small_args(tmp_path, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      shuffle_dataset=False)
    dataset = arithmetic_task(16)
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=dataset)
    trainer.train()
    assert len(calls) == 4                                      # 2 steps x 2 micro-batches
    first = [p for p in dataset["prompt"][:2] for _ in range(4)]   # 8 completions: 2 prompts x G=4, unshuffled
    assert calls[0][0] == calls[1][0] == first and calls[2][0] == calls[3][0] != first
    assert all(isinstance(loss, torch.Tensor) and not loss.requires_grad for _, loss in calls)
    assert [h["loss"] for h in trainer.history] == pytest.approx([(calls[0][1] + calls[1][1]).item(),
                                                              (calls[2][1] + calls[3][1]).item()])
    with pytest.raises(TypeError, match="TrainingInputs"):
        trainer.training_step(trainer.model, [{"prompt": "1+1="}])


def test_dataloaders_yield_what_the_loop_reads_with_trls_worker_rule(tmp_path):
    "get_train_dataloader: the loop's generation batches; an iterable eval set gets one worker, args unchanged."
    args = small_args(tmp_path, max_steps=1, dataloader_num_workers=2)
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(16),
                          eval_dataset=arithmetic_task(4, seed=1).to_iterable_dataset())
    train = trainer.get_train_dataloader()
    assert train.num_workers == 2 and len(train) == 8       # 16 prompts / 2 per generation batch
    rows, group = generation_rows(next(tr._epoch_chunks(trainer, 0, 0))[0], 4)
    assert next(iter(train)) == rows
    evaluation = trainer.get_eval_dataloader()
    assert evaluation.num_workers == 0 and args.dataloader_num_workers == 2
    assert sum(len(b) for b in evaluation) == 16             # 4 prompts x G=4


class _OffPolicyEngine(tr.GenerateEngine):
    "The policy's own samples, with sampling log-probs that differ from the policy's (as a vLLM engine's do)."
    def generate(self, rows, group, policy, settings, step):
        from grpo_lab.loss import completion_logps
        out = super().generate(rows, group, policy, settings, step)
        with torch.no_grad():
            ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
            mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
            logps, _ = completion_logps(policy, ids, mask, out.completion_ids.size(1), temperature=settings.temperature)
        shift = 0.05 * torch.sin(torch.arange(logps.numel(), dtype=logps.dtype)).reshape(logps.shape)
        out.sampling_logps = logps + shift
        return out


def test_is_correction_takes_old_logps_from_the_loss_forward_exactly(tmp_path, monkeypatch):
    "mu=1, one step per rollout, no dropout: the extra forward is skipped and loss, grads and sampling/* are unchanged."
    from grpo_lab import loss as loss_module

    def run(skip: bool, out):
        monkeypatch.setattr(tr, "_old_from_loss", tr._old_from_loss if skip else (lambda trainer: False))
        monkeypatch.setattr(tr, "_needs_old_logps", tr._needs_old_logps if skip else (lambda trainer: True))
        forwards = []
        logps = loss_module.completion_logps
        monkeypatch.setattr(tr, "completion_logps", lambda *a, **k: forwards.append(1) or logps(*a, **k))
        args = small_args(out, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          use_vllm=True, seed=3)
        trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(16),
                              engine=_OffPolicyEngine(AutoTokenizer.from_pretrained(TINY), torch.device("cpu"), share_prefill=None))
        trainer.train()
        return trainer, len(forwards)

    saved, saved_forwards = run(True, tmp_path / "a")
    monkeypatch.undo()
    extra, extra_forwards = run(False, tmp_path / "b")
    assert saved_forwards == 4 and extra_forwards == 6          # 2 steps x 2 micro-batches, +1 old-logp pass a step
    keys = ["loss", "grad_norm", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max"]
    for a, b in zip(saved.history, extra.history):
        assert all(k in a for k in keys)
        assert [a[k] for k in keys] == pytest.approx([b[k] for k in keys], rel=1e-5, abs=1e-6)
    assert same_weights(weights(saved), weights(extra)) or all(
        torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(weights(saved).values(), weights(extra).values()))
