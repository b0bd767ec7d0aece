"""The multiplication toy (grpo_lab.tasks): held-out tool use before and after a short GRPO run with tools=[multiply].

Issue 21 asks whether GRPO teaches a small chat model to use a calculator on 3-digit x 2-digit products, which it
cannot compute in its head. For each seed this script measures, on held-out problems (none of the training pairs),
the rate of rollouts that call the tool, the share of calls that are well formed, the accuracy (with and without a
call), and the accuracy with the calculator switched off (every call answered with an error: a model that learned
the tool loses its accuracy, one that learned to guess keeps it). With `--warm-start N` it first takes N supervised
steps on ideal transcripts (grpo_lab.tasks.warm_start) and measures again; then it trains `--steps` GRPO steps with
`product_reward` (and, with `--call-bonus`, 0.5 for a rollout whose calls ran, logged as its own reward) and
measures again. One JSON line per seed.

    python benchmarks/tool_toy.py --seeds 0 1 2 --eval 16 --warm-start 1 --warm-lr 3e-5 --steps 6 --learning-rate 3e-5  # SmolLM2-135M, CPU
    python benchmarks/tool_toy.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 50 --seeds 0 1 2   # hub, GPU
"""
import argparse, json, tempfile, time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.models import smollm2_path
from grpo_lab.tasks import held_out_stats, multiplication_problems, product_reward, warm_start
from grpo_lab.tools import multiply


def well_formed_call(completions, **kwargs) -> list[float]:
    "0.5 for a rollout whose tool calls all ran (a shaping reward for a model that never calls: `--call-bonus`)."
    return [0.5 if any(m["role"] == "tool" and not m["content"].startswith('{"error"') for m in c) else 0.0
            for c in completions]


def run_seed(model_name: str, seed: int, steps: int, n_train: int, n_eval: int, max_new_tokens: int,
             call_bonus: bool, warm_steps: int = 0, warm_lr: float = 1e-4, learning_rate: float = 1e-5,
             base: bool = False) -> dict:
    torch.manual_seed(seed)
    train = multiplication_problems(n_train, seed=seed)
    held = multiplication_problems(n_eval, seed=1000 + seed, exclude={(r["a"], r["b"]) for r in train})
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name)
    record = {"model": model_name, "seed": seed, "warm_start": warm_steps, "warm_lr": warm_lr, "steps": steps,
              "learning_rate": learning_rate, "held_out": n_eval, "max_new_tokens": max_new_tokens}
    start = time.perf_counter()
    if warm_steps and base:
        record["base"] = held_out_stats(model, tokenizer, held, max_new_tokens)
    if warm_steps:
        record["warm_start_losses"] = warm_start(model, tokenizer, train, warm_steps, learning_rate=warm_lr)
    record["before"] = held_out_stats(model, tokenizer, held, max_new_tokens)
    if steps:
        args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=8,
                          max_completion_length=max_new_tokens, max_tool_calling_iterations=1, max_steps=steps,
                          learning_rate=learning_rate, logging_steps=1, save_strategy="no", report_to="none",
                          seed=seed, disable_tqdm=True)
        rewards = [product_reward, well_formed_call] if call_bonus else product_reward
        trainer = GRPOTrainer(model, rewards, args=args, train_dataset=Dataset.from_list(train),
                              processing_class=tokenizer, tools=[multiply])
        trained = time.perf_counter()
        trainer.train()
        record["seconds_per_step"] = round((time.perf_counter() - trained) / steps, 1)
        logged = [h for h in trainer.state.log_history if "tools/call_frequency" in h]
        record["call_frequency_per_step"] = [h["tools/call_frequency"] for h in logged]
        record["product_reward_per_step"] = [h["rewards/product_reward/mean"] for h in logged]
        if call_bonus:
            record["call_bonus_per_step"] = [h["rewards/well_formed_call/mean"] for h in logged]
        record["after"] = held_out_stats(trainer.accelerator.unwrap_model(trainer.model), tokenizer, held,
                                         max_new_tokens)
    record["seconds"] = round(time.perf_counter() - start)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder or hub id (default: SmolLM2-135M-Instruct, built offline)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=0, help="GRPO steps (0: measure only)")
    p.add_argument("--train", type=int, default=64, help="training problems")
    p.add_argument("--eval", type=int, default=32, help="held-out problems")
    p.add_argument("--max-new-tokens", type=int, default=96, help="a call, its result and an answer take ~80")
    p.add_argument("--call-bonus", action="store_true", help="add 0.5 for a rollout whose calls ran")
    p.add_argument("--warm-start", type=int, default=0, help="supervised steps on ideal transcripts before GRPO")
    p.add_argument("--warm-lr", type=float, default=1e-4, help="the warm start's learning rate")
    p.add_argument("--learning-rate", type=float, default=1e-5, help="GRPO's learning rate")
    p.add_argument("--base", action="store_true", help="also measure the model before the warm start")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 for learning figures)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = a.model or str(smollm2_path())
    for seed in a.seeds:
        print(json.dumps(run_seed(model, seed, a.steps, a.train, a.eval, a.max_new_tokens, a.call_bonus,
                                  a.warm_start, a.warm_lr, a.learning_rate, a.base)), flush=True)


if __name__ == "__main__":
    main()
