"""The GPU check: the T4 rehearsal, the static engine against generate and TRL, QLoRA against TRL and grpo-lab's CUDA
tests, in one report, most valuable first.

Run through `bash benchmarks/gpu_check.sh` (it installs the carried wheels first); the Python part alone:

    python benchmarks/gpu_check.py --out runs/gpu-check            # on a GPU machine: under 6 minutes
    python benchmarks/gpu_check.py --out runs/gpu-check --dry-run  # on a CPU: the same stages at tiny shapes

Each stage runs under a time budget (the budgets add up to 330 s, under 6 minutes with the install); a stage that
fails or runs out of time is recorded with its error and with what it measured so far (steps done, seconds a step,
peak memory), and the next one runs. `--out` receives three files: report.json, report.md and gpu-check-logs.tar.gz
(every stage's log and output files).

Stages, in order: environment (versions, GPU, what imports); t4_rehearsal (the shipped colab-t4-qwen-gsm8k.yaml run
at its own shapes with a local random-weight Qwen2.5-0.5B and a local GSM8K-shaped dataset, fp16, the GPU answering
as a T4 does and the process capped at the T4's 15,360 MiB with torch.cuda.set_per_process_memory_fraction; seconds
a step, its peak memory against the cap and against estimate_memory, the 250 steps projected); engine_0.5b_bf16_lora
(`grpo-lab bench` at the random-weight Qwen2.5-0.5B shape with the static-cache engine against TRL, then with
`generate`: 2 prompts x 8 completions, prompts of 64 tokens, completions of exactly 128, 3 steps); bench_1.5b_qlora
(the same against TRL at the 1.5B shape on a 4-bit base); cuda_tests (tests/test_cuda.py). `demo` (`grpo-lab demo`,
shortened) runs only when named with --only, and so does sharded (issue 39: FSDP, and DeepSpeed ZeRO-2/3 where
`deepspeed` imports, each on one process, since world size 1 still runs the gather and save paths: 3 steps of the
tiny model and a saved model that loads and answers as the trained one; the dry mode runs FSDP on 2 CPU processes).
Run it in a second call: `--only sharded`. It is not yet measured on a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T4_MEMORY_MIB = 15360                 # a Colab T4's 15 GB as torch sees it
ESTIMATE_RTOL = 0.15                  # estimate_memory against the measured peak
MEMORY_RATIO_LIMIT = 1.10             # grpo-lab's peak memory against TRL's on the same benchmark (issue 30: 1.65x)
DEMO_MIN_LIFT = 0.05                  # held-out accuracy points the shortened demo must gain
PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "pyarrow", "trl", "fastcore",
            "grpo-lab")

T4_STEP_TARGET_S = 7.0                # a T4-rehearsal step on an H100/H200 (issue 38)
T4_PEAK_TARGET_MIB = 13500            # the rehearsal's peak under the 15,360 MiB cap
T4_RECIPE_STEPS = 250                 # the shipped recipe's max_steps, projected from the rehearsal's seconds a step
T4_RECIPE_TARGET_MIN = 30.0
ENGINE_GENERATION_SPEEDUP = 5.0       # the static engine's generation against generate's, 0.5B bf16 LoRA
ENGINE_STEP_RATIO = 0.3               # its step against TRL's
QLORA_STEP_RATIO = 0.5                # 1.5B QLoRA: step against TRL's (peak memory at most TRL's)

IN_PROCESS = ("cuda_tests", "engine_0.5b_bf16_lora", "bench_1.5b_qlora", "demo")   # the others import torch: a child each
# name: (budget on a GPU, budget in the dry mode), seconds; most valuable first. A new stage goes at the end.
STAGES = {"environment": (15, 30),
          "t4_rehearsal": (115, 60),
          "engine_0.5b_bf16_lora": (90, 120),
          "bench_1.5b_qlora": (65, 60),
          "cuda_tests": (45, 60)}
OPTIONAL_STAGES = {"demo": (60, 60), "sharded": (120, 150)}   # run only when named with --only
MAX_BUDGET_S = 330                         # the default budget at most: one call of 6 minutes with the install
BENCH = {"engine_0.5b_bf16_lora": ["--shape", "qwen2.5-0.5b", "--lora-r", "16"],
         "bench_1.5b_qlora": ["--shape", "qwen2.5-1.5b", "--lora-r", "16", "--load-in-4bit"]}
BENCH_SIZES = {False: ["--pd", "16", "-G", "8", "--prompt-length", "64", "--completion-length", "128", "--steps", "3"],
               True: ["--shape", "tiny", "--lora-r", "4", "--pd", "4", "-G", "2", "--prompt-length", "16",
                      "--completion-length", "4", "--steps", "2", "--threads", "1"]}
DRY_CUDA_TESTS = "test_precision_row_trains and fp32-weights-bf16-mixed-lora and not beta0.04"


# --- the stages (each runs in a child process: `gpu_check.py --stage NAME`) ----------------------------------------

def check(name: str, ok, detail: str = "") -> dict:
    "One check of a stage: ok is True, False, or None (does not apply here, e.g. a GPU figure in the dry mode)."
    return {"name": name, "ok": None if ok is None else bool(ok), "detail": detail}


def stage_environment(dry: bool, work: Path, deadline: float) -> dict:
    "Versions, the GPU, and which of grpo-lab's needs import."
    import importlib
    import platform
    from importlib.metadata import PackageNotFoundError, version
    import torch
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    imports = {}
    for module in ("grpo_lab.trainer", "bitsandbytes", "datasets", "trl", "fastcore"):
        try:
            importlib.import_module(module)
            imports[module] = "ok"
        except Exception as e:      # any import failure is a finding to report, not a crash of the check
            imports[module] = f"{type(e).__name__}: {str(e)[:300]}"
    cuda = torch.cuda.is_available()
    figures = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
               "torch_cuda": torch.version.cuda, "cuda_available": cuda, "versions": versions, "imports": imports,
               "install": _install_record()}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(gpu=props.name, capability=list(torch.cuda.get_device_capability(0)),
                       gpu_memory_mib=round(props.total_memory / 2**20), bf16_supported=torch.cuda.is_bf16_supported())
    checks = [check("a CUDA GPU is visible", None if dry else cuda, figures.get("gpu", "none")),
              *(check(f"{m} imports", status == "ok", status) for m, status in imports.items())]
    return {"figures": figures, "checks": checks}


def _install_record() -> dict | None:
    "What gpu_check.sh installed from the wheels folder (it writes this record), if anything."
    path = os.environ.get("GPU_CHECK_INSTALL_JSON")
    return json.loads(Path(path).read_text()) if path and Path(path).exists() else None


def _run(command: list[str], log: Path, deadline: float, env: dict | None = None) -> tuple[int | None, str]:
    "Run `command` until `deadline` (its process group killed then); exit status (None: out of time) and output."
    with open(log, "a") as f:
        f.write(f"$ {' '.join(command)}\n")
        f.flush()
        proc = subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    return code, log.read_text(errors="replace")


def stage_cuda_tests(dry: bool, work: Path, deadline: float) -> dict:
    "tests/test_cuda.py (the cuda marker; the slow memory and demo tests are the stages below); the dry mode runs two."
    command = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-m", "cuda and not slow", "-v", "-rs",
               "-p", "no:cacheprovider", "--durations=10"]
    env = {}
    if dry:
        command += ["-k", DRY_CUDA_TESTS]
        env["GRPO_LAB_CUDA_TESTS_ON_CPU"] = "1"
    code, output = _run(command, work / "pytest.log", deadline - 5, env)
    results = dict(re.findall(r"^tests/test_cuda\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", output, re.M))
    counts = {s.lower(): sum(v == s for v in results.values()) for s in ("PASSED", "FAILED", "SKIPPED", "ERROR")}
    failures = dict(re.findall(r"^(?:FAILED|ERROR) tests/test_cuda\.py::(\S+)(?: - (.*))?$", output, re.M))
    skips = sorted(set(re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", output, re.M)))
    figures = {"counts": counts, "failed": {k: v[:400] for k, v in failures.items()}, "skip_reasons": skips[:20],
               "exit_status": code, "finished": code is not None}
    checks = [check("pytest finished within its budget", code is not None, f"exit status {code}"),
              check("tests ran", sum(counts.values()) > 0, json.dumps(counts)),
              check("no test failed", counts["failed"] + counts["error"] == 0, ", ".join(list(failures)[:10]))]
    return {"figures": figures, "checks": checks, **({"ended": "timeout"} if code is None else {})}


def _bench(name: str, engine: str, with_trl: bool, dry: bool, work: Path, deadline: float) -> tuple[dict | None, str]:
    "One `grpo-lab bench` at the stage's shape with grpo-lab's `engine`: its bench.json (None if it did not finish), how it ended."
    out = work / f"bench-{engine}"
    shape = [] if dry else BENCH[name]
    extra = ["--load-in-4bit"] if dry and "qlora" in name else []
    command = [sys.executable, "-m", "grpo_lab.bench", *shape, *BENCH_SIZES[dry], *extra, "--fixed-length",
               "--generation-engine", engine, "--repeats", "1", "--quiet", "--output-dir", str(out)]
    if not with_trl:
        command.append("--no-trl")
    (work / "tmp").mkdir(exist_ok=True)             # the bench's scratch folder: its finished runs stay readable
    code, output = _run(command, work / f"bench-{engine}.log", deadline - 3, env={"TMPDIR": str(work / "tmp")})
    if code == 0 and (out / "bench.json").exists():
        return json.loads((out / "bench.json").read_text()), "finished"
    return None, "ran out of time" if code is None else f"exited {code}: {output[-1500:]}"


def finished_runs(work: Path) -> list[dict]:
    "What a stage's unfinished bench left: each trainer run it finished, with its steps, seconds a step and peak memory."
    runs = []
    for path in sorted(work.glob("tmp/grpo-lab-bench-*/*-[0-9].json")):
        run = json.loads(path.read_text())
        runs.append({"trainer": run["trainer"], "steps_done": len(run["steps"]),
                     "seconds_a_step": [round(step["total"], 3) for step in run["steps"]],
                     "peak_memory_mib": round(run["peak_memory_mib"])})
    return runs


def progress(work: Path) -> dict:
    "What a stage measured before it ran out of time: the T4 rehearsal's steps so far, the bench runs it finished."
    path = work / "progress.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    runs = finished_runs(work)
    return {**found, **({"finished_bench_runs": runs} if runs else {})}


BENCH_KEYS = ("total", "generation", "forward", "backward_update", "tokens_per_s", "peak_memory_mib")


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    return round(a[key] / b[key], 3) if a and b and b[key] else None


def stage_bench(name: str, dry: bool, work: Path, deadline: float) -> dict:
    """`grpo-lab bench` at one shape against TRL where it imports (one run each); the engine stage then runs grpo-lab
    again with `generate`. Figures from bench.json; a bench that runs out of time leaves the runs it finished."""
    from importlib.util import find_spec
    trl = find_spec("trl") is not None and not (dry and "qlora" in name)    # dry: TRL's path is run once, not twice
    engine_stage = name.startswith("engine_")
    plan = [("static", trl), ("generate", False)] if engine_stage else [("auto", trl)]
    results, ended = {}, {}
    for engine, with_trl in plan:
        result, ended[engine] = _bench(name, engine, with_trl, dry, work, deadline)
        if result is None:
            break
        results[engine] = result
    rows = {}
    for engine, result in results.items():
        for kind, row in result["summary"].items():
            if kind != "ratio":
                rows[kind if kind == "trl" else f"grpo-lab {engine}"] = {k: round(row[k], 4) for k in BENCH_KEYS}
    first = next(iter(results.values()), None)
    figures = {"description": first and first["description"], "trl_status": first and first["trl"], "ended": ended, **rows}
    lab, trl_row = rows.get("grpo-lab static" if engine_stage else "grpo-lab auto"), rows.get("trl")
    figures["step_over_trl"] = _ratio(lab, trl_row, "total")
    figures["peak_memory_over_trl"] = _ratio(lab, trl_row, "peak_memory_mib")
    done = all(how == "finished" for how in ended.values()) and len(ended) == len(plan)
    checks = [check("every bench run finished within the budget", done, json.dumps(ended)[:400]),
              check("compared with TRL", None if dry and not trl else trl_row is not None, str(figures["trl_status"]))]
    if engine_stage:
        generate = rows.get("grpo-lab generate")
        speedup = _ratio(generate, lab, "generation")
        figures["generation_speedup_over_generate"] = speedup
        if lab and first:
            figures["decode_ms_a_token"] = round(1000 * lab["generation"] / first["settings"]["completion_length"], 2)
        checks += [check(f"generation >= {ENGINE_GENERATION_SPEEDUP}x faster than generate",
                         None if dry or speedup is None else speedup >= ENGINE_GENERATION_SPEEDUP, f"{speedup}x"),
                   check(f"step <= {ENGINE_STEP_RATIO}x TRL's", None if dry or figures["step_over_trl"] is None
                         else figures["step_over_trl"] <= ENGINE_STEP_RATIO, f"{figures['step_over_trl']}x")]
    else:
        memory = figures["peak_memory_over_trl"]
        checks += [check("peak memory <= TRL's", None if dry or memory is None else memory <= 1.0,
                         f"{memory}x" if memory else "no TRL run" if not dry else "dry mode: RSS, not GPU memory"),
                   check(f"step <= {QLORA_STEP_RATIO}x TRL's", None if dry or figures["step_over_trl"] is None
                         else figures["step_over_trl"] <= QLORA_STEP_RATIO, f"{figures['step_over_trl']}x")]
    if not done:
        figures["partial"] = progress(work)
    timed_out = all(how in ("finished", "ran out of time") for how in ended.values())
    return {"figures": figures, "checks": checks, **({} if done else {"ended": "timeout" if timed_out else "failed"})}


def _t4_model(dry: bool, folder: Path):
    "The rehearsal's model folder (tokenizer inside): random-weight Qwen2.5-0.5B, or a tiny Qwen2 in the dry mode."
    from transformers import GenerationConfig
    from grpo_lab.bench import BenchSettings, bench_tokenizer, load_tokenizer, prepare_model
    from grpo_lab.models import random_tiny_model
    if dry:
        tokenizer = bench_tokenizer(256)
        model = random_tiny_model(256, hidden_size=64, num_hidden_layers=2, max_position_embeddings=1024)
        model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        model.save_pretrained(folder)
    else:
        prepare_model(BenchSettings(shape="qwen2.5-0.5b"), folder)
        tokenizer = load_tokenizer(folder)
    tokenizer.save_pretrained(folder)
    return model.config if dry else None, tokenizer


def _gsm8k_like(tokenizer, path: Path, rows: int, words: int):
    "A local GSM8K-shaped file: questions of `words` ordinary tokens, answers ending in '#### <number>'."
    import random
    rng = random.Random(0)
    vocab = [t for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if t.startswith("w")]
    with open(path, "w") as f:
        for i in range(rows):
            question = " ".join(rng.choice(vocab) for _ in range(words))
            f.write(json.dumps({"question": question, "answer": f"w1 w2 w3\n#### {rng.randint(1, 999)}"}) + "\n")


def _progress_callback(path: Path, deadline: float, cuda: bool):
    """A callback that writes what the run measured after each step (steps done, seconds a step, peak memory) to
    `path`, and stops the run when the next step would not end before `deadline`, so that the stage still reports.
    GPU_CHECK_DEADLINE_AFTER_STEPS=N makes the deadline count as reached after N steps (the dry test's way in)."""
    import torch
    from transformers import TrainerCallback
    from grpo_lab.bench import peak_memory_mib
    stop_after = int(os.environ.get("GPU_CHECK_DEADLINE_AFTER_STEPS", "0")) or None

    class Progress(TrainerCallback):
        def __init__(self):
            self.seconds, self.stopped, self.last = [], False, time.time()

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.time()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.time()
            self.seconds.append(round(now - self.last, 2))
            self.last = now
            peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_memory_mib()[0]
            path.write_text(json.dumps({"steps_done": state.global_step, "seconds_a_step": self.seconds,
                                        "peak_memory_mib": round(peak)}))
            next_step_late = now + 1.2 * self.seconds[-1] > deadline - 15
            if state.global_step < state.max_steps and (next_step_late or (stop_after and state.global_step >= stop_after)):
                self.stopped = control.should_training_stop = True
    return Progress()


def stage_t4_rehearsal(dry: bool, work: Path, deadline: float) -> dict:
    """The shipped T4 run at its own shapes, a few steps, with the GPU answering as a T4 does (capability 7.5, no bf16)
    and the process capped at the T4's memory; seconds a step, its peak memory, the recipe's 250 steps projected."""
    import torch
    from grpo_lab.cli import load_run, resolve_reward
    from grpo_lab.data import format_gsm8k
    from grpo_lab.memory import estimate_memory, model_config
    from grpo_lab.trainer import GRPOTrainer
    cuda = torch.cuda.is_available() and not dry
    if cuda:           # what a T4 answers: grpo-lab then takes the T4's path (fp16 compute for the 4-bit layers)
        torch.cuda.get_device_capability = lambda *a, **k: (7, 5)
        torch.cuda.is_bf16_supported = lambda *a, **k: False
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, T4_MEMORY_MIB * 2**20 / total))    # "fits a T4", tested
    config, tokenizer = _t4_model(dry, work / "model")
    _gsm8k_like(tokenizer, work / "gsm8k.jsonl", rows=64, words=40 if dry else 240)
    overrides = {"output_dir": str(work / "out"), "max_steps": "2" if dry else "3", "save_strategy": "no",
                 "logging_steps": "1", "report_to": "none", "disable_tqdm": "true"}
    if dry:            # fp16 autocast needs CUDA; the rest of the run as shipped, at tiny lengths
        overrides.update(fp16="false", use_cpu="true", max_prompt_length="32", max_completion_length="8",
                         gradient_accumulation_steps="1")
    model_name, dataset_spec, rewards, args, shortcuts = load_run(ROOT / "configs" / "colab-t4-qwen-gsm8k.yaml", overrides)
    args.generation_kwargs = {"min_new_tokens": args.max_completion_length}        # every completion full length
    dataset = format_gsm8k(str(work / "gsm8k.jsonl"))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    trainer = GRPOTrainer(str(work / "model"), [resolve_reward(r) for r in rewards], args=args, train_dataset=dataset,
                          processing_class=tokenizer, **shortcuts)
    progress_callback = _progress_callback(work / "progress.json", deadline, cuda)
    trainer.add_callback(progress_callback)
    trainer.train()
    seconds = time.time() - started
    if cuda:
        peak, kind = torch.cuda.max_memory_allocated() / 2**20, "torch.cuda.max_memory_allocated"
    else:
        from grpo_lab.bench import peak_memory_mib
        peak, kind = peak_memory_mib()
    engine = type(trainer.engine).__name__
    merged_copy = bool(getattr(trainer.engine, "merged_copy", False))
    estimate = estimate_memory(config or model_config("Qwen/Qwen2.5-0.5B-Instruct"), load_in_4bit=True, lora_r=shortcuts["lora_r"],
                               num_generations=args.num_generations,
                               per_device_train_batch_size=args.per_device_train_batch_size,
                               max_prompt_length=args.max_prompt_length, max_completion_length=args.max_completion_length,
                               gradient_checkpointing=args.gradient_checkpointing, generation_copy=merged_copy,
                               static_cache=engine == "StaticCacheEngine",
                               generation_rows=trainer.plan.generation_batch_size).total * 1024
    compute = sorted({str(m.compute_dtype).removeprefix("torch.") for m in trainer.model.modules() if hasattr(m, "compute_dtype")})
    losses = [h["loss"] for h in trainer.history]
    step_seconds = progress_callback.seconds
    warm = step_seconds[1:] or step_seconds               # the first step compiles and captures the decode step
    per_step = sum(warm) / len(warm) if warm else math.nan
    projected = T4_RECIPE_STEPS * per_step / 60
    figures = {"model": model_name + (" (random weights, local)" if not dry else " (dry: tiny random Qwen2)"),
               "dataset": f"local GSM8K-shaped file, 64 rows (the shipped run reads {dataset_spec['source']})",
               "engine": engine, "merged_copy": merged_copy, "steps": trainer.state.global_step,
               "max_steps": args.max_steps, "seconds_a_step": step_seconds, "seconds_a_step_after_first": round(per_step, 2),
               "projected_minutes_for_250_steps": round(projected, 1), "losses": losses,
               "seconds": round(seconds, 1), "peak_memory_mib": round(peak), "memory_kind": kind,
               "t4_limit_mib": T4_MEMORY_MIB, "estimate_mib": round(estimate),
               "estimate_over_measured": round(estimate / peak, 3), "bf16": args.bf16, "fp16": args.fp16,
               "compute_dtypes_4bit": compute, "lengths": f"{args.max_prompt_length}+{args.max_completion_length}",
               "completions_per_micro_step": args.per_device_train_batch_size,
               "gradient_accumulation_steps": args.gradient_accumulation_steps}
    checks = [check("ran every step within the budget", not progress_callback.stopped,
                    f"{trainer.state.global_step} of {args.max_steps} steps"),
              check("trained with finite losses", losses and all(math.isfinite(x) for x in losses), str(losses)),
              check("T4 path: fp16 compute, bf16 off", None if dry else (compute == ["float16"] and not args.bf16 and args.fp16),
                    f"compute {compute}, bf16={args.bf16}, fp16={args.fp16}"),
              check(f"a step <= {T4_STEP_TARGET_S:.0f} s (after the first)", None if dry else per_step <= T4_STEP_TARGET_S,
                    f"{per_step:.2f} s"),
              check(f"peak memory <= {T4_PEAK_TARGET_MIB} MiB (under the T4's {T4_MEMORY_MIB})",
                    None if dry else peak <= T4_PEAK_TARGET_MIB, f"{peak:.0f} MiB"),
              check(f"estimate_memory within {ESTIMATE_RTOL:.0%} of the peak",
                    None if dry else abs(estimate / peak - 1) <= ESTIMATE_RTOL, f"estimate {estimate:.0f} MiB, peak {peak:.0f} MiB"),
              check(f"the recipe's {T4_RECIPE_STEPS} steps projected <= {T4_RECIPE_TARGET_MIN:.0f} min",
                    None if dry else projected <= T4_RECIPE_TARGET_MIN, f"{projected:.1f} min")]
    return {"figures": figures, "checks": checks, **({"ended": "timeout"} if progress_callback.stopped else {})}


def stage_demo(dry: bool, work: Path, deadline: float) -> dict:
    "`grpo-lab demo` on the tiny model, shortened (300 steps on a GPU; 2 in the dry mode): held-out accuracy rises."
    steps, size, every = (2, 10, 2) if dry else (300, 500, 150)
    command = [sys.executable, "-m", "grpo_lab.cli", "demo", "--steps", str(steps), "--eval-size", str(size),
               "--eval-every", str(every), "--output-dir", str(work / "demo"), "--overwrite"]
    code, output = _run(command, work / "demo.log", deadline - 3)
    summary_file = work / "demo" / "summary.json"
    if code != 0 or not summary_file.exists():
        raise RuntimeError(f"grpo-lab demo {'ran out of time' if code is None else f'exited {code}'}:\n{output[-3000:]}")
    s = json.loads(summary_file.read_text())
    lift = s["accuracy_after"] - s["accuracy_before"]
    figures = {k: s[k] for k in ("steps", "seconds", "seconds_per_step", "accuracy_before", "accuracy_after", "eval_problems")}
    figures["lift_points"] = round(100 * lift, 1)
    checks = [check("ran every step", s["steps"] == steps, str(s["steps"])),
              check(f"held-out accuracy rose by >= {DEMO_MIN_LIFT * 100:.0f} points", None if dry else lift >= DEMO_MIN_LIFT,
                    f"{100 * s['accuracy_before']:.1f}% -> {100 * s['accuracy_after']:.1f}%")]
    return {"figures": figures, "checks": checks}


SHARDED_SCRIPT = """
import json, sys
from transformers import AutoModelForCausalLM
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer
from grpo_lab.sharded import gathered_for_generation, held_bytes
from grpo_lab.trainer import GRPOConfig, GRPOTrainer
out = sys.argv[1]
args = GRPOConfig(output_dir=out + "/run", per_device_train_batch_size=8, num_generations=8, max_steps=3, beta=0.04,
                  learning_rate=1e-3, max_prompt_length=32, max_completion_length=6, logging_steps=1,
                  save_strategy="no", disable_tqdm=True, report_to="none")
trainer = GRPOTrainer(str(tiny_model_path()), exact_answer, args=args, train_dataset=arithmetic_task(64, seed=3))
trainer.train()
trainer.save_model(out + "/model")
acc, device = trainer.accelerator, trainer.accelerator.device
ids = [trainer.processing_class(p, return_tensors="pt").input_ids.to(device) for p in ("3+4=", "12+9=")]
with gathered_for_generation(trainer) as policy:
    trained = [policy.generate(i, max_new_tokens=6, do_sample=False)[0].tolist() for i in ids]
if acc.is_main_process:
    loaded = AutoModelForCausalLM.from_pretrained(out + "/model").to(device).eval()
    saved = [loaded.generate(i, max_new_tokens=6, do_sample=False)[0].tolist() for i in ids]
    json.dump({"distributed_type": str(acc.distributed_type), "processes": acc.num_processes,
               "losses": [h["loss"] for h in trainer.history], "held_bytes": held_bytes(trainer),
               "saved_answers_equal": saved == trained}, open(out + "/result.json", "w"))
"""


def stage_sharded(dry: bool, work: Path, deadline: float) -> dict:
    "FSDP and (where deepspeed imports) ZeRO-2/3 on one GPU process: 3 steps, a saved model that loads and answers alike."
    import importlib.util
    from grpo_lab.scale import export_run, read_run
    (work / "sharded.py").write_text(SHARDED_SCRIPT)
    strategies = ["fsdp"] + (["zero2", "zero3"] if importlib.util.find_spec("deepspeed") else [])
    figures, checks = {"deepspeed": "imports" if len(strategies) > 1 else "not carried (no deepspeed wheel)"}, []
    for strategy in strategies:
        folder = work / strategy
        run = {**read_run(ROOT / "configs" / "tiny-cpu.yaml"), "per_device_train_batch_size": 8}    # the script's batch
        export = export_run(run, folder / "export", num_processes=2 if dry else 1,
                            strategy=strategy, cpu=dry, mixed_precision="no" if dry else "bf16", allow_untested=True)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(export / "accelerate_config.yaml")]
        if strategy != "fsdp":
            command += ["--deepspeed_config_file", str(export / "ds_config.json")]
        command += ["--main_process_port", "29517", str(work / "sharded.py"), str(folder)]
        code, output = _run(command, folder / "launch.log", deadline - 3, env={"ACCELERATE_USE_CPU": "true"} if dry else None)
        result = json.loads((folder / "result.json").read_text()) if (folder / "result.json").exists() else None
        figures[strategy] = result or {"exit": code, "output": output[-1500:]}
        ok = code == 0 and result is not None
        checks.append(check(f"{strategy}: 3 steps with finite losses", ok and len(result["losses"]) == 3
                            and all(math.isfinite(x) for x in result["losses"]), str(result and result["losses"])))
        checks.append(check(f"{strategy}: the saved model loads and answers as the trained one",
                            ok and result["saved_answers_equal"], "" if ok else f"exit {code}"))
    return {"figures": figures, "checks": checks}


ALL_STAGES = {**STAGES, **OPTIONAL_STAGES}


def run_stage(name: str, dry: bool, work: Path, deadline: float) -> dict:
    if name in BENCH:
        return stage_bench(name, dry, work, deadline)
    return globals()[f"stage_{name}"](dry, work, deadline)


# --- the driver --------------------------------------------------------------------------------------------------

def drive(names: list[str], dry: bool, work: Path, budget: float) -> list[dict]:
    "Run each stage in a child process under its budget (clipped to what is left); record its outcome."
    end, results = time.time() + budget, []
    for name in names:
        left = end - time.time()
        stage_budget = min(ALL_STAGES[name][1 if dry else 0], left - 5)
        folder = work / name
        folder.mkdir(parents=True, exist_ok=True)
        record = {"name": name, "budget_s": round(max(stage_budget, 0)), "seconds": 0.0, "figures": {}, "checks": []}
        if stage_budget < 10:
            results.append({**record, "status": "skipped", "error": f"out of time: {left:.0f} s of the {budget:.0f} s left"})
            continue
        started = time.time()
        print(f"[gpu-check] {name}: up to {stage_budget:.0f} s", flush=True)
        result_file = folder / "result.json"
        if name in IN_PROCESS:              # these only drive commands and read their files: no torch import here
            try:
                result_file.write_text(json.dumps(run_stage(name, dry, folder, started + stage_budget), default=str))
                code, output = 0, ""
            except Exception as e:          # a stage's failure is recorded, and the next stage runs
                import traceback
                code, output = 1, "".join(traceback.format_exception(e))
                if "ran out of time" in str(e):
                    code = None
        else:
            command = [sys.executable, __file__, "--stage", name, "--work", str(folder), "--deadline",
                       str(started + stage_budget)] + (["--dry-run"] if dry else [])
            code, output = _run(command, folder / "stage.log", started + stage_budget + 5)
        record["seconds"] = round(time.time() - started, 1)
        if result_file.exists():
            record.update(json.loads(result_file.read_text()))
        if code is None:                    # killed at its deadline: what it measured so far
            record["figures"] = {**record["figures"], "partial": progress(folder)}
            record.update(status="timeout", error=f"stopped after {stage_budget:.0f} s: {output[-1500:]}")
        elif code != 0 or not result_file.exists():
            record.update(status="failed", error=record.get("error") or f"exit {code}: {output[-1500:]}")
        else:
            failed = [c["name"] for c in record["checks"] if c["ok"] is False]
            ended = record.pop("ended", None)          # a stage that stopped itself to report in time: "timeout"
            record.update(status=ended or ("failed" if failed else "passed"),
                          error=f"checks failed: {failed}" if failed else None)
        print(f"[gpu-check] {name}: {record['status']} in {record['seconds']} s", flush=True)
        results.append(record)
    return results


def markdown(report: dict) -> str:
    "The report as Markdown: what ran where, a table of stages, then each stage's figures and failed checks."
    m = report["machine"]
    lines = [f"# grpo-lab GPU check ({'DRY RUN on the CPU: no figure here is a GPU measurement' if report['dry_run'] else 'GPU'})",
             "", f"{report['finished']}, {report['seconds']} s of the {report['budget_s']} s budget; "
             f"GPU: {m.get('gpu') or 'none'}; torch {m['versions'].get('torch')} (CUDA {m.get('torch_cuda')}), "
             f"transformers {m['versions'].get('transformers')}, trl {m['versions'].get('trl')}, "
             f"bitsandbytes {m['versions'].get('bitsandbytes')}.", "",
             f"**{report['summary']['passed']} of {len(report['stages'])} stages passed**"
             + (f"; failed: {', '.join(report['summary']['not_passed'])}" if report["summary"]["not_passed"] else ""), "",
             "| stage | status | seconds (budget) | checks |", "|---|---|---|---|"]
    for s in report["stages"]:
        marks = " ".join({True: "ok", False: "FAIL", None: "n/a"}[c["ok"]] + f": {c['name']}" for c in s["checks"])
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} ({s['budget_s']}) | {marks or '-'} |")
    for s in report["stages"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        if s.get("error"):
            lines += ["```", str(s["error"])[-2000:], "```", ""]
        for c in s["checks"]:
            if c["ok"] is False or c["detail"]:
                lines.append(f"- {'FAIL' if c['ok'] is False else 'ok' if c['ok'] else 'n/a'} {c['name']}: {c['detail']}")
        if s["figures"]:
            lines += ["", "```json", json.dumps(s["figures"], indent=1)[:4000], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check", help="where the report goes")
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY") == "1",
                   help="the same stages at tiny shapes on the CPU (also GPU_CHECK_DRY=1)")
    p.add_argument("--budget", type=float, default=None, help="seconds for all stages (default: their budgets' sum, "
                   "330 on a GPU and dry)")
    p.add_argument("--only", default=None, help="comma-separated stage names (default: all, in order)")
    p.add_argument("--keep-work", action="store_true", help="keep the stages' folders (models, runs) under --out/work")
    p.add_argument("--stage", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.stage:                                   # a child: one stage, its result as JSON in its folder
        work = Path(a.work)
        result = run_stage(a.stage, a.dry_run, work, a.deadline)
        (work / "result.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    names = a.only.split(",") if a.only else list(STAGES)
    unknown = [n for n in names if n not in ALL_STAGES]
    if unknown:
        p.error(f"unknown stage(s) {unknown}: pick from {list(ALL_STAGES)}")
    budget = a.budget or min(MAX_BUDGET_S, sum(budgets[1 if a.dry_run else 0] for budgets in STAGES.values()))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    work = out / "work" if a.keep_work else Path(tempfile.mkdtemp(prefix="grpo-lab-gpu-check-"))
    stages = drive(names, a.dry_run, work, budget)
    env = next((s["figures"] for s in stages if s["name"] == "environment" and s["figures"]), None)
    if env is None:
        env = stage_environment(a.dry_run, work, time.time() + 30)["figures"]
    report = {"dry_run": a.dry_run, "finished": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "seconds": round(time.time() - started, 1), "budget_s": budget, "machine": env, "stages": stages,
              "summary": {"passed": sum(s["status"] == "passed" for s in stages),
                          "not_passed": [s["name"] for s in stages if s["status"] != "passed"]}}
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    with tarfile.open(out / "gpu-check-logs.tar.gz", "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and (path.suffix in (".log", ".json", ".png", ".jsonl") and path.stat().st_size < 5e6):
                tar.add(path, arcname=str(path.relative_to(work)))
    if not a.keep_work:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu-check] {report['summary']['passed']} of {len(stages)} stages passed; wrote {out}/report.json, "
          f"report.md and gpu-check-logs.tar.gz", flush=True)
    return 0 if not report["summary"]["not_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
