"""Issue 43's ablation: do grpo-lab and TRL 1.16 train the same model when they draw the same random numbers?

`benchmarks/parity_seeds.py` found grpo-lab ahead of TRL by 10 points of held-out accuracy over 8 seeds of one recipe,
while another recipe had TRL ahead. The update from given completions is tested equal
(`tests/test_learning_parity.py`), so this script takes the sampling's randomness out instead: it reseeds torch's
global generator before every `generate` call (`torch.manual_seed(1000 * seed + call)`, the same in both trainers),
records every completion each trainer's reward function receives, trains the recipe's 16 steps and measures held-out
accuracy. If the trainers differed anywhere (sampling settings, the engine, the update, the schedule, the data order),
their completions would part at some step and the accuracies would differ.

    OMP_NUM_THREADS=1 python benchmarks/parity_aligned.py --trainer trl --seed 0 --output runs/aligned.json
    OMP_NUM_THREADS=1 python benchmarks/parity_aligned.py --trainer grpo-lab --seed 0 --output runs/aligned.json
    OMP_NUM_THREADS=1 python benchmarks/parity_aligned.py --trainer grpo-lab-padded --seed 0 --output runs/aligned.json
    python benchmarks/parity_aligned.py --compare runs/aligned.json

`grpo-lab-padded` swaps grpo-lab's default shared-prefill engine for its padded `generate` engine.
Without the reseeding (`--no-align`) each trainer keeps its own stream, which is what a user gets.
"""
import argparse
import json
import time
from pathlib import Path

import parity_seeds as recipe
import torch

from grpo_lab.rewards import numeric_answer as score


def align_generation(seed: int) -> None:
    "Reseed torch's global generator before every `generate` call: the same numbers for the same call in any trainer."
    from transformers.generation.utils import GenerationMixin
    original, calls = GenerationMixin.generate, [0]

    def generate(self, *args, **kwargs):
        calls[0] += 1
        torch.manual_seed(1000 * seed + calls[0])
        return original(self, *args, **kwargs)

    GenerationMixin.generate = generate


def run(trainer_name: str, seed: int, align: bool, steps: int) -> dict:
    if align:
        align_generation(seed)
    received = []

    def numeric_answer(prompts, completions, answer, **kwargs):
        received.append([c[0]["content"] if isinstance(c, list) else c for c in completions])
        return score(prompts, completions, answer, **kwargs)

    recipe.numeric_answer = numeric_answer           # the recipe's reward, recording what it is given
    recipe.RECIPE["max_steps"] = steps
    _, train_set, held_out = recipe.demo_problems("smollm2", seed, recipe.EVAL_SIZE)
    logs, started = recipe.TrainingLogs(), time.perf_counter()
    name = "trl" if trainer_name == "trl" else "grpo-lab"
    trainer = recipe.make_trainer(name, train_set, seed, f"/tmp/parity-aligned-{trainer_name}-{seed}-{time.time_ns()}",
                                  logs)
    if trainer_name == "grpo-lab-padded":
        from grpo_lab.rollout import GenerateEngine
        trainer.engine = GenerateEngine(trainer.processing_class, trainer.accelerator.device, share_prefill=False)
    trainer.train()
    accuracy = recipe.held_out_accuracy(trainer.model, trainer.processing_class, held_out,
                                        score, recipe.EVAL_TOKENS)
    return {"trainer": trainer_name, "seed": seed, "aligned": align, "steps": steps, "accuracy_after": accuracy,
            "learning_rates": [r.get("learning_rate") for r in logs.records], "completions": received,
            "seconds": round(time.perf_counter() - started, 1)}


def compare(path: str) -> None:
    "Per seed: each trainer's accuracy, and at how many of each step's completions it agrees with TRL's."
    runs = [json.loads(line) for line in Path(path).read_text().splitlines()]
    for seed in sorted({r["seed"] for r in runs}):
        for aligned in (True, False):
            group = {r["trainer"]: r for r in runs if r["seed"] == seed and r["aligned"] == aligned}
            if "trl" not in group:
                continue
            ref = group["trl"]["completions"]
            for name, r in sorted(group.items()):
                same = [sum(a == b for a, b in zip(x, y)) for x, y in zip(r["completions"], ref)]
                print(f"seed {seed} {'aligned' if aligned else 'own streams'} {name:16s} accuracy "
                      f"{r['accuracy_after']:.3f}  completions equal to TRL's: {sum(same)}/{sum(map(len, ref))} "
                      f"(per step {same})")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainer", choices=("trl", "grpo-lab", "grpo-lab-padded"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--no-align", action="store_true", help="each trainer keeps its own random stream")
    p.add_argument("--output", default="runs/parity-aligned.json")
    p.add_argument("--compare", metavar="JSON")
    a = p.parse_args()
    if a.compare:
        compare(a.compare)
    else:
        torch.set_num_threads(1)
        result = run(a.trainer, a.seed, not a.no_align, a.steps)
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        with open(a.output, "a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "completions"}))
