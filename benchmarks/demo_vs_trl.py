"""`grpo-lab demo --model smollm2`, and the same run with TRL's GRPOTrainer, seed by seed.

    python benchmarks/demo_vs_trl.py --trainer grpo-lab --seed 0 1 2 --output runs/demo-smollm2-lab.json
    /path/to/python-with-trl benchmarks/demo_vs_trl.py --trainer trl --seed 0 1 2 --output runs/demo-smollm2-trl.json

Both trainers get the demo recipe of `grpo_lab.cli.DEMO_RECIPES` (model, prompts, rewards, LoRA adapter, batch,
learning rate, completion length, temperature 1, constant schedule, beta 0, loss dapo) and the same held-out
problems, scored by the same greedy rule before and after training. Each seed prints one JSON line: accuracy
before/after, the lift in points, median seconds per optimizer step, total seconds and peak resident memory.
TRL is an optional `bench` extra (`pip install 'grpo-lab[bench]'`), never a runtime dependency.
"""
import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from grpo_lab import rewards
from grpo_lab.cli import DEMO_RECIPES, demo_problems, held_out_accuracy


class StepTimer(TrainerCallback):
    "Seconds of every optimizer step, measuring nothing else."
    def __init__(self):
        self.seconds, self.started = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)


def trainer_for(name: str, recipe, model_path, train_set, reward_funcs, seed: int, output_dir: str, timer):
    "A grpo-lab or TRL trainer on identical settings."
    common = dict(output_dir=output_dir, per_device_train_batch_size=recipe.prompts_per_step * recipe.num_generations,
                  num_generations=recipe.num_generations, max_steps=recipe.steps, learning_rate=recipe.learning_rate,
                  max_completion_length=recipe.max_new_tokens, temperature=1.0, lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="no", seed=seed, report_to="none", gradient_checkpointing=False,
                  beta=0.0, loss_type="dapo", disable_tqdm=True, bf16=False)
    if name == "grpo-lab":
        from grpo_lab.trainer import GRPOConfig, GRPOTrainer
        return GRPOTrainer(str(model_path), reward_funcs, args=GRPOConfig(**common),
                           train_dataset=train_set, callbacks=[timer], lora_r=recipe.lora_r)
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer
    lora = LoraConfig(r=recipe.lora_r, lora_alpha=2 * recipe.lora_r, lora_dropout=0.0, target_modules="all-linear",
                      task_type="CAUSAL_LM")
    return GRPOTrainer(str(model_path), reward_funcs, args=GRPOConfig(**common, use_cpu=True), train_dataset=train_set,
                       callbacks=[timer], peft_config=lora)


def run(name: str, seed: int, model: str = "smollm2") -> dict:
    recipe = DEMO_RECIPES[model]
    model_path, train_set, held_out = demo_problems(model, seed, recipe.eval_size)
    reward_funcs = [getattr(rewards, r) for r in recipe.rewards]
    accuracy_rule = getattr(rewards, recipe.accuracy)
    timer, t0 = StepTimer(), time.perf_counter()
    trainer = trainer_for(name, recipe, model_path, train_set, reward_funcs, seed, f"/tmp/demo-vs-trl-{name}-{seed}", timer)
    tokenizer = trainer.processing_class
    before = held_out_accuracy(trainer.model, tokenizer, held_out, accuracy_rule, recipe.max_new_tokens)
    trainer.train()
    after = held_out_accuracy(trainer.model, tokenizer, held_out, accuracy_rule, recipe.max_new_tokens)
    steps = sorted(timer.seconds)
    return {"trainer": name, "model": model, "seed": seed, "accuracy_before": before, "accuracy_after": after,
            "lift_points": round((after - before) * 100, 1), "seconds_per_step": round(steps[len(steps) // 2], 2),
            "seconds": round(time.perf_counter() - t0, 1),
            "peak_memory_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "threads": torch.get_num_threads()}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainer", choices=("grpo-lab", "trl"), required=True)
    p.add_argument("--seed", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--model", default="smollm2", choices=sorted(DEMO_RECIPES))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--output", default=None, help="append each seed's JSON line to this file")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.threads:
        torch.set_num_threads(a.threads)
    for seed in a.seed:
        result = run(a.trainer, seed, a.model)
        print(json.dumps(result), flush=True)
        if a.output:
            Path(a.output).parent.mkdir(parents=True, exist_ok=True)
            with open(a.output, "a") as f:
                f.write(json.dumps(result) + "\n")
