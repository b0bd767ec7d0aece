"""Issue 43's ladder: the `grpo-lab demo` run on the tiny model with one GRPO trick at a time toggled, over seeds.

Every arm is the demo's recipe (`grpo_lab.cli.DEMO_RECIPES["tiny"]`: 16 prompts x 8 completions of up to 5 tokens
per step, full fine-tuning, lr 3e-4 linear, loss_type "dapo", scale_rewards "group", beta 0, reward `exact_answer`)
with `--steps` optimizer steps and one change (`ARMS`). Held-out greedy accuracy on the demo's 500 unseen problems is
measured every `--eval-every` steps; the time kept per step is the step alone (the measuring excluded). The arms run
interleaved, seed by seed (baseline, trick 1, trick 2, ..., then the next seed), so that a busy machine slows them
alike, and every run records the load average it started under.

    nice -n 5 python benchmarks/ladder.py --seeds 0 1 2 --steps 200 --output benchmarks/results/ladder-2026-11-27.jsonl
    python benchmarks/ladder.py --summarize benchmarks/results/ladder-2026-11-27.jsonl

`CLIP_ARMS` gives clip-higher something to clip (each batch learned from twice), recorded apart:

    nice -n 5 python benchmarks/ladder.py --arms "num_iterations=2" "num_iterations=2, epsilon_high=0.28" --seeds 0 1 2 \
        --steps 150 --eval-every 15 --output benchmarks/results/ladder-clip-higher-2026-11-27.jsonl

`benchmarks/dynamic_sampling.py` runs two of these arms (baseline, dynamic_sampling) with more seeds; `--reuse` copies
that record's runs of the same recipe (arm, seed and steps) into this one, each marked with `"from"`, instead of running
them again:

    nice -n 5 python benchmarks/ladder.py --seeds 0 1 --steps 150 --eval-every 15 \
        --reuse benchmarks/results/dynamic-sampling-2026-11-27.jsonl --output benchmarks/results/ladder-2026-11-27.jsonl
"""
import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

ARMS = {
    "baseline": {},
    "dynamic_sampling": {"dynamic_sampling": True},                    # DAPO: refill zero-variance groups (max 4 rounds)
    "epsilon_high=0.28": {"epsilon_high": 0.28},                       # DAPO's clip-higher: two-sided clip 0.2 / 0.28
    "loss_type=grpo": {"loss_type": "grpo"},                           # the paper's per-sequence mean (baseline: dapo)
    "scale_rewards=none": {"scale_rewards": "none"},                   # Dr. GRPO: no division by the group's std
    "beta=0.04": {"beta": 0.04},                                       # the KL term against the starting policy
    "entropy_coef=0.01": {"entropy_coef": 0.01},                       # an entropy bonus (TRL 1.16's entropy_coef)
    "overlong_punishment": {"overlong": (5, 1)},   # DAPO's soft overlong punishment, a second reward: up to 4 tokens
}                                                  # free (an answer of <= 3 characters and EOS), 5 tokens -1
# Clip-higher acts only where the ratio leaves 1: with each batch learned from twice. Compared with each other, not with
# the baseline (two changes); recorded apart (benchmarks/results/ladder-clip-higher-2026-11-27.jsonl).
CLIP_ARMS = {
    "num_iterations=2": {"num_iterations": 2},
    "num_iterations=2, epsilon_high=0.28": {"num_iterations": 2, "epsilon_high": 0.28},
}


def _held_out_callback(held_out, every: int, max_new_tokens: int, points: list, step_seconds: list, step_cpu: list,
                       score=None):
    """A callback appending `(step, accuracy, training seconds so far, training CPU seconds so far)` at the start and
    every `every` steps; `step_seconds` and `step_cpu` get each step's wall and CPU (this process) seconds. `score`:
    the reward that says a greedy answer is right (the tiny task's `exact_answer` unless given)."""
    from transformers import TrainerCallback
    from grpo_lab.cli import held_out_accuracy
    from grpo_lab.rewards import exact_answer
    score = score or exact_answer

    class HeldOut(TrainerCallback):
        def measure(self, state, kwargs):
            accuracy = held_out_accuracy(kwargs["model"], kwargs["processing_class"], held_out, score, max_new_tokens)
            points.append((state.global_step, accuracy, round(sum(step_seconds), 3), round(sum(step_cpu), 3)))

        def on_train_begin(self, args, state, control, **kwargs):
            self.measure(state, kwargs)

        def on_step_begin(self, args, state, control, **kwargs):
            self.started, self.started_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            step_seconds.append(time.perf_counter() - self.started)
            step_cpu.append(time.process_time() - self.started_cpu)
            if state.global_step % every == 0 or state.global_step == state.max_steps:
                self.measure(state, kwargs)

    return HeldOut()


# DAPO's soft overlong punishment per model: (max_completion_len, soft_punish_cache) of `get_soft_overlong_punishment`.
# The tiny model answers in at most 4 tokens (EOS included): only a 5-token completion pays. SmolLM2's answers to an
# addition take 3-8 tokens; its 16-token limit with a cache of 4 makes the last 4 tokens cost up to -1.
OVERLONG = {"tiny": (5, 1), "smollm2": (16, 4)}


def run_arm(arm: str, seed: int, steps: int, eval_every: int, eval_size: int | None = None, changes: dict | None = None,
            model: str = "tiny") -> dict:
    "One demo run of `arm` (a name of `ARMS`, or any name with `changes`) on the demo `model` (`tiny`, `smollm2`): its record."
    from grpo_lab import rewards
    from grpo_lab.cli import demo_config, demo_problems, demo_recipe
    from grpo_lab.scripts import get_soft_overlong_punishment
    from grpo_lab.trainer import GRPOTrainer
    changes = dict({**ARMS, **CLIP_ARMS}[arm] if changes is None else changes)
    recorded = dict(changes)
    recipe = demo_recipe(model, steps=steps, eval_every=eval_every, eval_size=eval_size)
    model_path, train_set, held_out = demo_problems(model, seed, recipe.eval_size)
    reward_funcs = [getattr(rewards, name) for name in recipe.rewards]
    if "overlong" in changes:
        changes.pop("overlong")
        reward_funcs.append(get_soft_overlong_punishment(*OVERLONG[model]))
        recorded["overlong"] = OVERLONG[model]
    points, step_seconds, step_cpu = [], [], []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        args = dataclasses.replace(demo_config(out, recipe, seed), save_strategy="no", logging_steps=1,
                                   disable_tqdm=True, **changes)
        callback = _held_out_callback(held_out, eval_every, recipe.max_new_tokens, points, step_seconds, step_cpu,
                                      getattr(rewards, recipe.accuracy))
        started = time.perf_counter()
        trainer = GRPOTrainer(str(model_path), reward_funcs, args=args, train_dataset=train_set, callbacks=[callback],
                              lora_r=recipe.lora_r)
        trainer.train()
        seconds = time.perf_counter() - started
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {"arm": arm, "changes": recorded, "model": model, "eval_problems": recipe.eval_size,
            "seed": seed, "steps": trainer.state.global_step, "accuracy_before": points[0][1],
            "accuracy": points[-1][1], "train_seconds": round(sum(step_seconds), 2), "train_cpu_seconds": round(sum(step_cpu), 2),
            "seconds": round(seconds, 2), "loadavg": [round(x, 2) for x in load],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "torch_threads": torch.get_num_threads(),
            "accuracy_curve": points,
            "reward_curve": [(h["step"], round(h["reward"], 4)) for h in logs],
            "length_curve": [(h["step"], round(h["completions/mean_length"], 2)) for h in logs if "completions/mean_length" in h],
            "clipped_ratio": [(h["step"], h["completions/clipped_ratio"]) for h in logs if "completions/clipped_ratio" in h],
            "frac_reward_zero_std": [(h["step"], h.get("frac_reward_zero_std")) for h in logs],
            "rounds": [(h["step"], h["dynamic_sampling/rounds"]) for h in logs if "dynamic_sampling/rounds" in h]}


def run_interleaved(arms: list[str], seeds: list[int], steps: int, eval_every: int, output: Path, threads: int = 1,
                    reuse: Path | None = None, model: str = "tiny", eval_size: int | None = None):
    """Every arm for seed 0, then every arm for seed 1, ...: each run appended to `output` as one JSON line; a run of
    the same arm, seed and steps in the record `reuse` is copied (marked `"from"`) instead of run."""
    torch.set_num_threads(threads)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["arm"], r["seed"], r["steps"]): r for r in (read_runs(reuse) if reuse else [])}
    for seed in seeds:
        for arm in arms:
            if (arm, seed, steps) in done:
                with output.open("a") as f:
                    f.write(json.dumps({**done[arm, seed, steps], "from": reuse.name}) + "\n")
                continue
            record = run_arm(arm, seed, steps, eval_every, eval_size, model=model)
            with output.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{arm:>22} seed {seed}: accuracy {record['accuracy_before']:.1%} -> {record['accuracy']:.1%}, "
                  f"train {record['train_seconds']:.0f} s ({record['train_cpu_seconds']:.0f} s CPU), run {record['seconds']:.0f} s, load {record['loadavg'][0]}",
                  flush=True)


def read_runs(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(runs: list[dict]) -> str:
    "Per arm: accuracy and training seconds (mean, sd, min-max) and the mean per-seed ratios of wall and CPU seconds to the baseline's."
    base = {r["seed"]: r for r in runs if r["arm"] == "baseline"}
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    rows = ["| arm | seeds | held-out accuracy, mean (sd) [min-max] | lift vs baseline, points | train seconds, mean (sd) | "
            "wall / baseline's | CPU / baseline's |", "|---|---|---|---|---|---|---|"]
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        acc = [100 * r["accuracy"] for r in mine]
        sec = [r["train_seconds"] for r in mine]
        paired = [r for r in mine if r["seed"] in base]
        lift = statistics.mean(100 * (r["accuracy"] - base[r["seed"]]["accuracy"]) for r in paired) if paired else float("nan")
        ratio = statistics.mean(r["train_seconds"] / base[r["seed"]]["train_seconds"] for r in paired) if paired else float("nan")
        cpu = statistics.mean(r["train_cpu_seconds"] / base[r["seed"]]["train_cpu_seconds"] for r in paired) if paired else float("nan")
        sd = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0
        rows.append(f"| {arm} | {len(mine)} | {statistics.mean(acc):.1f}% ({sd(acc):.1f}) [{min(acc):.1f}-{max(acc):.1f}] | "
                    f"{lift:+.1f} | {statistics.mean(sec):.0f} ({sd(sec):.0f}) | {ratio:.2f} | {cpu:.2f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=[*ARMS, *CLIP_ARMS])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="tiny", choices=sorted(OVERLONG), help="the demo recipe to climb the ladder on")
    p.add_argument("--eval-size", type=int, default=None, help="held-out problems (default: the demo recipe's)")
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/ladder-2026-11-27.jsonl"))
    p.add_argument("--reuse", type=Path, default=None, help="a record whose runs of the same arm, seed and steps are copied")
    p.add_argument("--summarize", type=Path, default=None, help="print the table of a record and exit")
    a = p.parse_args()
    if a.summarize:
        print(summarize(read_runs(a.summarize)))
    else:
        run_interleaved(a.arms, a.seeds, a.steps, a.eval_every, a.output, a.threads, a.reuse, a.model, a.eval_size)
        print(summarize(read_runs(a.output)))
