"""grpo-lab vs TRL on identical settings, in one run: seconds per optimizer step on the shipped tiny model.

    pip install trl          # the comparison needs TRL; grpo-lab itself never does
    python benchmarks/bench_vs_trl.py --steps 30

Both trainers get the same model, tokenizer, prompts, reward, batch arithmetic, sampling and
optimizer settings; each runs in its own fresh process, one after the other, and the script
prints the figures and the ratio. This is a benchmark that prints figures, not a test.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SETTINGS = dict(per_device_train_batch_size=64, gradient_accumulation_steps=1, num_generations=8,
                max_completion_length=6, learning_rate=5e-5, lr_scheduler_type="constant", beta=0.0,
                loss_type="dapo", temperature=1.0, seed=0)


def run(kind: str, steps: int) -> dict:
    "Train `steps` optimizer steps with grpo-lab or TRL in this process; return timing."
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_lab.data import arithmetic_task
    from grpo_lab.models import tiny_model_path
    from grpo_lab.rewards import exact_answer
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    data = arithmetic_task(2000, seed=11)
    out = tempfile.mkdtemp()
    path = str(tiny_model_path())
    if kind == "grpo-lab":
        from grpo_lab import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=out, max_steps=steps, max_prompt_length=32, logging_steps=steps,
                          save_steps=10 * steps, disable_tqdm=True, **SETTINGS)
        trainer = GRPOTrainer(path, exact_answer, args=args, train_dataset=data)
    else:
        from trl import GRPOConfig, GRPOTrainer
        args = GRPOConfig(output_dir=out, max_steps=steps, logging_steps=steps, save_strategy="no", report_to="none",
                          use_cpu=True, bf16=False, disable_tqdm=True, **SETTINGS)
        model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
        trainer = GRPOTrainer(model=model, reward_funcs=exact_answer, args=args, train_dataset=data, processing_class=tok)
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    return {"trainer": kind, "steps": steps, "seconds": round(seconds, 2), "s_per_step": round(seconds / steps, 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--child", choices=["grpo-lab", "trl"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(run(a.child, a.steps)))
        return
    rows = []
    for kind in ("grpo-lab", "trl"):
        r = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(a.steps)],
                           capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if r.returncode != 0:
            sys.exit(f"{kind} failed:\n{r.stderr[-3000:]}")
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    c = SETTINGS
    print(f"tiny model, {c['per_device_train_batch_size']} completions/step (G={c['num_generations']}), "
          f"max {c['max_completion_length']} new tokens, {a.steps} steps, CPU threads={os.environ.get('BENCH_THREADS', '2')}")
    for row in rows:
        print(f"{row['trainer']:>9}: {row['seconds']:7.2f} s  {row['s_per_step']:.3f} s/step")
    print(f"TRL / grpo-lab time ratio: {rows[1]['seconds'] / rows[0]['seconds']:.2f}")


if __name__ == "__main__":
    main()
