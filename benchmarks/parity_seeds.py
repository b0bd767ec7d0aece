"""Issue 23's learning-parity recipe, seed by seed, with grpo-lab's or TRL's GRPOTrainer (only the import changes).

    OMP_NUM_THREADS=1 python benchmarks/parity_seeds.py --trainer grpo-lab --seed 0 1 2 3 4 5 6 7 --output runs/lab.json
    OMP_NUM_THREADS=1 python benchmarks/parity_seeds.py --trainer trl --seed 0 1 2 3 4 5 6 7 --output runs/trl.json
    python benchmarks/parity_seeds.py --compare runs/lab.json runs/trl.json

The recipe: SmolLM2-135M-Instruct in float32, one LoRA adapter (r=16, alpha 32, dropout 0, all linear layers, the same
`peft.LoraConfig` given to both), 2 prompts x 4 completions per optimizer step (per_device_train_batch_size 4,
gradient_accumulation_steps 2, num_generations 4), 16 new tokens, temperature 0.7, learning rate 2e-4 on a linear
schedule, loss_type "dapo", beta 0, 16 optimizer steps. The prompts are the SmolLM2 demo's two-digit additions
(`grpo_lab.cli.demo_problems`: the training draw follows the seed, the 200 held-out problems are fixed), rewarded by
`numeric_answer`; held-out accuracy is the share of greedy completions `numeric_answer` scores 1
(`grpo_lab.cli.held_out_accuracy`), the same code for both trainers. Each seed prints one JSON line (accuracy after
training, the mean training reward, completion length and entropy over the 16 steps, seconds); the untrained
accuracy is measured once per process (the adapter starts as the identity: lora_B = 0). `--compare` prints both
distributions, Welch's t and an exact permutation test on the difference of means, and an exact sign-flip test on
the per-seed differences (a seed fixes the prompt order in both trainers: TRL's RepeatSampler and grpo-lab's
generation_chunks draw the same torch.randperm; the sampled completions differ).
"""
import argparse
import json
import math
import os
import resource
import statistics
import time
from itertools import combinations
from pathlib import Path

import grpo_lab  # noqa: F401  (first: its import filter quiets a bitsandbytes notice)
import torch
from transformers import TrainerCallback

from grpo_lab.cli import demo_problems, held_out_accuracy
from grpo_lab.rewards import numeric_answer

RECIPE = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
              max_completion_length=16, temperature=0.7, learning_rate=2e-4, lr_scheduler_type="linear",
              loss_type="dapo", beta=0.0, max_steps=16)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
EVAL_SIZE, EVAL_TOKENS = 200, 16


class TrainingLogs(TrainerCallback):
    "Every logged training record (reward, lengths, entropy, ...), and the seconds of each optimizer step."
    def __init__(self):
        self.records, self.seconds, self.started = [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self.started)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.records.append(dict(logs))

    def mean(self, key: str) -> float | None:
        values = [r[key] for r in self.records if key in r]
        return round(sum(values) / len(values), 4) if values else None


def make_trainer(name: str, train_set, seed: int, output_dir: str, callback):
    "The recipe's trainer, grpo-lab's or TRL's: the same arguments, the same adapter config; only the import differs."
    from peft import LoraConfig
    if name == "grpo-lab":
        from grpo_lab import GRPOConfig, GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    from grpo_lab.models import smollm2_path
    args = GRPOConfig(output_dir=output_dir, seed=seed, use_cpu=True, bf16=False, gradient_checkpointing=False,
                      logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, **RECIPE)
    return GRPOTrainer(str(smollm2_path()), numeric_answer, args=args, train_dataset=train_set, callbacks=[callback],
                       peft_config=LoraConfig(**LORA))


def run(name: str, seed: int, measure_before: bool) -> dict:
    _, train_set, held_out = demo_problems("smollm2", seed, EVAL_SIZE)
    logs, t0 = TrainingLogs(), time.perf_counter()
    trainer = make_trainer(name, train_set, seed, f"/tmp/parity-seeds-{name}-{seed}", logs)
    model, tokenizer = trainer.model, trainer.processing_class
    before = held_out_accuracy(model, tokenizer, held_out, numeric_answer, EVAL_TOKENS) if measure_before else None
    trainer.train()
    train_seconds = time.perf_counter() - t0
    after = held_out_accuracy(model, tokenizer, held_out, numeric_answer, EVAL_TOKENS)
    steps = sorted(logs.seconds)
    return {"trainer": name, "seed": seed, "accuracy_before": before, "accuracy_after": after,
            "steps": trainer.state.global_step, "mean_reward": logs.mean("reward"),
            "mean_length": logs.mean("completions/mean_length"), "mean_entropy": logs.mean("entropy"),
            "rewards": [round(r["reward"], 4) for r in logs.records],
            "seconds_per_step": round(steps[len(steps) // 2], 2), "train_seconds": round(train_seconds, 1),
            "seconds": round(time.perf_counter() - t0, 1),
            "peak_memory_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "threads": torch.get_num_threads(), "load": os.getloadavg()[0]}


def welch(a: list[float], b: list[float]) -> tuple[float, float, float]:
    "Welch's t, its degrees of freedom and the two-sided p-value (Student's t distribution, by numeric integration)."
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    t = (statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    density = lambda x: (1 + x * x / df) ** (-(df + 1) / 2)
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
    n, top = 20000, abs(t)                       # P(|T| > |t|) = 1 - 2 * integral_0^|t| density (Simpson's rule)
    h = top / n
    area = sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(i * h) for i in range(n + 1)) * h / 3
    return t, df, max(0.0, 1 - 2 * norm * area)


def permutation_p(a: list[float], b: list[float]) -> float:
    "Exact two-sided permutation test on the difference of means: the share of relabellings at least as extreme."
    pooled, observed = a + b, abs(statistics.mean(a) - statistics.mean(b))
    total, extreme = 0, 0
    for idx in combinations(range(len(pooled)), len(a)):
        chosen = set(idx)
        x = [pooled[i] for i in idx]
        y = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        total += 1
        extreme += abs(statistics.mean(x) - statistics.mean(y)) >= observed - 1e-12
    return extreme / total


def paired_p(a: list[float], b: list[float]) -> float:
    "Exact two-sided sign-flip test on the mean per-seed difference (a seed fixes the prompts, not the completions)."
    diffs = [x - y for x, y in zip(a, b)]
    observed, total, extreme = abs(sum(diffs)), 0, 0
    for signs in range(2 ** len(diffs)):
        flipped = sum(d if signs >> i & 1 else -d for i, d in enumerate(diffs))
        total += 1
        extreme += abs(flipped) >= observed - 1e-12
    return extreme / total


def compare(paths: list[str]) -> None:
    "Both distributions of held-out accuracy after training, and whether their means differ."
    runs = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            runs.setdefault(r["trainer"], {})[r["seed"]] = r      # a later line for the same seed replaces one
    (name_a, a_runs), (name_b, b_runs) = sorted(runs.items())
    seeds = sorted(set(a_runs) | set(b_runs))
    print("| seed | " + " | ".join(str(s) for s in seeds) + " | mean | std |")
    print("|---" * (len(seeds) + 3) + "|")
    for key, label in (("accuracy_after", "held-out accuracy %"), ("mean_reward", "mean training reward"),
                       ("mean_length", "mean completion length"), ("mean_entropy", "mean entropy")):
        for name, rs in ((name_a, a_runs), (name_b, b_runs)):
            values = [rs[s][key] * (100 if key == "accuracy_after" else 1) for s in seeds if s in rs]
            cells = [f"{rs[s][key] * (100 if key == 'accuracy_after' else 1):.4g}" if s in rs else "" for s in seeds]
            print(f"| {name} {label} | " + " | ".join(cells) +
                  f" | {statistics.mean(values):.4g} | {statistics.stdev(values):.3g} |")
    for key in ("accuracy_after", "mean_reward"):
        a = [a_runs[s][key] for s in seeds if s in a_runs]
        b = [b_runs[s][key] for s in seeds if s in b_runs]
        t, df, p = welch(a, b)
        print(f"{key}: {name_a} - {name_b} = {statistics.mean(a) - statistics.mean(b):+.4f}; Welch t = {t:.2f} "
              f"(df {df:.1f}), p = {p:.3f}; exact permutation p = {permutation_p(a, b):.3f}")
        both = [s for s in seeds if s in a_runs and s in b_runs]
        print(f"  paired by seed ({len(both)} seeds): exact sign-flip p = "
              f"{paired_p([a_runs[s][key] for s in both], [b_runs[s][key] for s in both]):.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainer", choices=("grpo-lab", "trl"))
    p.add_argument("--seed", type=int, nargs="+", default=list(range(8)))
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: learning figures, not timings)")
    p.add_argument("--output", default=None, help="append each seed's JSON line to this file")
    p.add_argument("--skip-before", action="store_true",
                   help="do not measure the untrained accuracy (the same for every seed)")
    p.add_argument("--compare", nargs="+", metavar="JSON", help="summarise result files instead of training")
    a = p.parse_args()
    if a.compare:
        compare(a.compare)
        raise SystemExit(0)
    if a.trainer is None:
        p.error("--trainer is required unless --compare is given")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    for i, seed in enumerate(a.seed):
        result = run(a.trainer, seed, measure_before=i == 0 and not a.skip_before)
        print(json.dumps(result), flush=True)
        if a.output:
            Path(a.output).parent.mkdir(parents=True, exist_ok=True)
            with open(a.output, "a") as f:
                f.write(json.dumps(result) + "\n")
