"""Do grpo-lab's engines and TRL's generation draw from the same distribution? Many rollouts of the same prompts.

    OMP_NUM_THREADS=1 python benchmarks/sampling_vs_trl.py --completions 32 --output runs/sampling.json

SmolLM2-135M-Instruct in float32 with the issue-23 recipe's fresh LoRA adapter (r=16, B = 0: the policy at step 0),
8 of the demo's two-digit-addition prompts, `--completions` completions each at temperature 0.7, 16 new tokens,
generated in batches of 8 prompts x 4 completions (32 rows). Three samplers: grpo-lab's
padded `generate` engine, its shared-prefill engine (both through `GRPOTrainer._completions`) and TRL 1.16's
`GRPOTrainer._generate`. Each sampler gets its own seeds (independent samples; `--same-seeds` gives all three the
same seeds instead, where grpo-lab's padded engine and TRL draw identical tokens). For every completion: its length
(tokens up to and including EOS), whether it ended with EOS, and per token the entropy of the distribution it was
drawn from (from generate's processed scores) and the sampled token's log-prob. Printed: means, quantiles and
two-sample Kolmogorov-Smirnov tests (statistic and asymptotic p-value) of lengths, per-completion mean entropy and
per-token entropy, each grpo-lab sampler against TRL.
"""
import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import grpo_lab  # noqa: F401  (first: its import filter quiets a bitsandbytes notice)
import torch

from grpo_lab.cli import demo_problems

G, PROMPTS_PER_BATCH, NEW_TOKENS, TEMPERATURE, N_PROMPTS = 4, 8, 16, 0.7, 8
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def reward_zero(completions, **kwargs):
    return [0.0] * len(completions)


class RecordScores:
    "Wraps a model's `generate` on the instance and keeps the processed scores of its last call."
    def __init__(self, model):
        self.generate, self.scores = model.generate, None
        model.generate = self

    def __call__(self, *args, **kwargs):
        out = self.generate(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
        self.scores = torch.stack(out.scores, 1).float()
        return out.sequences

    def per_token(self, completion_ids: torch.Tensor, mask: torch.Tensor) -> list[dict]:
        "Per row: the entropy of each step's sampling distribution and the sampled token's log-prob, up to EOS."
        logp = torch.log_softmax(self.scores[:, :completion_ids.size(1)], -1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
        sampled = logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        return [{"entropy": e[m.bool()].tolist(), "logp": s[m.bool()].tolist()}
                for e, s, m in zip(entropy, sampled, mask)]


def trainers(train_set, output_dir: str):
    "grpo-lab's and TRL's trainers on the same settings and adapter config (nothing is trained)."
    from peft import LoraConfig
    import trl
    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.models import smollm2_path
    common = dict(per_device_train_batch_size=PROMPTS_PER_BATCH * G, num_generations=G,
                  max_completion_length=NEW_TOKENS, temperature=TEMPERATURE, use_cpu=True, bf16=False,
                  report_to="none", save_strategy="no", disable_tqdm=True, max_steps=1, seed=0)
    path = str(smollm2_path())
    lab = GRPOTrainer(path, reward_zero, args=GRPOConfig(output_dir=f"{output_dir}/lab", **common),
                      train_dataset=train_set, peft_config=LoraConfig(**LORA))
    theirs = trl.GRPOTrainer(path, reward_zero, args=trl.GRPOConfig(output_dir=f"{output_dir}/trl", **common),
                             train_dataset=train_set, peft_config=LoraConfig(**LORA))
    return lab, theirs


def lab_sampler(trainer, engine, recorder: RecordScores):
    "A function of (prompt rows, seed) -> per-completion records, through grpo-lab's trainer and `engine`."
    from grpo_lab.steps import generation_rows

    def sample(prompts: list[dict], seed: int) -> list[dict]:
        trainer.engine = engine
        rows, group = generation_rows(prompts, G)
        torch.manual_seed(seed)
        out = trainer._completions(rows, group)
        tokens = recorder.per_token(out.completion_ids, out.completion_mask)
        return [{"prompt": r["prompt"][0]["content"], "length": int(m.sum()), "eos": not bool(t), **tok,
                 "ids": c[m.bool()].tolist()}
                for r, m, t, tok, c in zip(rows, out.completion_mask, out.truncated, tokens, out.completion_ids)]
    return sample


def trl_sampler(trainer):
    "The same for TRL's `_generate` (prompts repeated G times, as its sampler hands them over)."
    recorder = RecordScores(trainer.accelerator.unwrap_model(trainer.model))
    pad = trainer.processing_class.pad_token_id
    eos = set(trainer.eos_token_ids)

    def sample(prompts: list[dict], seed: int) -> list[dict]:
        trainer.model.train()
        repeated = [p["prompt"] for p in prompts for _ in range(G)]
        torch.manual_seed(seed)
        _, completion_ids = trainer._generate(repeated)[:2]
        length = max(map(len, completion_ids))
        ids = torch.tensor([list(c) + [pad] * (length - len(c)) for c in completion_ids])
        mask = torch.tensor([[1] * len(c) + [0] * (length - len(c)) for c in completion_ids])
        tokens = recorder.per_token(ids, mask)
        return [{"prompt": p[0]["content"], "length": len(c), "eos": bool(c) and c[-1] in eos, **tok, "ids": list(c)}
                for p, c, tok in zip(repeated, completion_ids, tokens)]
    return sample


def ks(a: list[float], b: list[float]) -> tuple[float, float]:
    "Two-sample Kolmogorov-Smirnov statistic and its asymptotic p-value (conservative where values tie)."
    a, b = sorted(a), sorted(b)
    values, i, j, d = sorted(set(a) | set(b)), 0, 0, 0.0
    for v in values:
        while i < len(a) and a[i] <= v:
            i += 1
        while j < len(b) and b[j] <= v:
            j += 1
        d = max(d, abs(i / len(a) - j / len(b)))
    n = len(a) * len(b) / (len(a) + len(b))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def quantiles(x: list[float]) -> list[float]:
    "10th, 25th, 50th, 75th and 90th percentiles."
    x = sorted(x)
    return [round(x[min(len(x) - 1, int(q * len(x)))], 3) for q in (0.1, 0.25, 0.5, 0.75, 0.9)]


def summary(records: list[dict]) -> dict:
    tokens = [e for r in records for e in r["entropy"]]
    per_completion = [statistics.mean(r["entropy"]) for r in records if r["entropy"]]
    lengths = [r["length"] for r in records]
    return {"completions": len(records), "mean_length": round(statistics.mean(lengths), 3),
            "length_quantiles": quantiles(lengths),
            "eos_share": round(sum(r["eos"] for r in records) / len(records), 3),
            "mean_token_entropy": round(statistics.mean(tokens), 4), "token_entropy_quantiles": quantiles(tokens),
            "mean_completion_entropy": round(statistics.mean(per_completion), 4),
            "mean_token_logp": round(statistics.mean(l for r in records for l in r["logp"]), 4),
            "distinct_completions": len({(r["prompt"], tuple(r["ids"])) for r in records})}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--completions", type=int, default=32, help="completions per prompt (a multiple of 4)")
    p.add_argument("--same-seeds", action="store_true", help="every sampler gets the same seeds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", default=None, help="write the summaries and the tests to this JSON file")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    _, train_set, _ = demo_problems("smollm2", 0, 200)
    prompts = [train_set[i] for i in range(N_PROMPTS)]
    lab, theirs = trainers(train_set, "/tmp/sampling-vs-trl")
    from grpo_lab.rollout import GenerateEngine
    recorder = RecordScores(lab.accelerator.unwrap_model(lab.model))
    samplers = {"grpo-lab generate": lab_sampler(lab, GenerateEngine(lab.processing_class), recorder),
                "grpo-lab shared prefill": lab_sampler(lab, GenerateEngine(lab.processing_class, share_prefill=None), recorder),
                "trl": trl_sampler(theirs)}
    records, seconds = {name: [] for name in samplers}, {name: 0.0 for name in samplers}
    rounds = a.completions // G
    for k, name in enumerate(samplers):
        for r in range(rounds):
            for start in range(0, N_PROMPTS, PROMPTS_PER_BATCH):
                seed = 1000 * r + start + (0 if a.same_seeds else 100_000 * (k + 1))
                t0 = time.perf_counter()
                records[name] += samplers[name](prompts[start:start + PROMPTS_PER_BATCH], seed)
                seconds[name] += time.perf_counter() - t0
    result = {"completions_per_prompt": a.completions, "prompts": N_PROMPTS, "same_seeds": a.same_seeds,
              "threads": torch.get_num_threads(), "load": os.getloadavg()[0],
              "summary": {name: {**summary(rs), "seconds": round(seconds[name], 1)} for name, rs in records.items()},
              "ks_vs_trl": {}}
    base = records["trl"]
    for name in ("grpo-lab generate", "grpo-lab shared prefill"):
        rs = records[name]
        tests = {"length": ks([r["length"] for r in rs], [r["length"] for r in base]),
                 "completion_mean_entropy": ks([statistics.mean(r["entropy"]) for r in rs],
                                               [statistics.mean(r["entropy"]) for r in base]),
                 "token_entropy": ks([e for r in rs for e in r["entropy"]], [e for r in base for e in r["entropy"]])}
        if a.same_seeds:
            same = sum(x["ids"] == y["ids"] for x, y in zip(rs, base))
            tests["identical_completions"] = (same, len(rs))
        result["ks_vs_trl"][name] = {k: [round(v, 4) for v in t] if k != "identical_completions" else list(t)
                                     for k, t in tests.items()}
    print(json.dumps(result, indent=1))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        Path(a.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
