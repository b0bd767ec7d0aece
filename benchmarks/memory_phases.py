"""Peak allocated bytes per phase of a GRPO step, grpo-lab against TRL 1.16 on identical settings, measured on the CPU.

    python benchmarks/memory_phases.py --shape qwen2.5-1.5b --layers 2 --pd 16 -G 8 --prompt-length 64 \\
        --completion-length 128 --lora-r 16 --load-in-4bit --fixed-length --steps 2 --variants main no-upcast fix

(the H200 run's settings, `grpo-lab bench --shape qwen2.5-1.5b --pd 16 -G 8 --prompt-length 64 --completion-length 128
--lora-r 16 --load-in-4bit --fixed-length`, cut to 2 layers; gradient checkpointing is off, the bench's default, in
both trainers; about 10 minutes a run on one busy core). `--explain` also lists what is alive at each phase's peak.

It answers "where does a GPU run's memory go" without a GPU. Each trainer runs in a fresh process on the same model
folder and prompts (`grpo_lab.bench` builds both trainers exactly as `grpo-lab bench` does). Two things make the CPU
stand in for a bf16 GPU run (switch them off with `--dtype float32`):

- the compute dtype is bf16: `grpo_lab.models.compute_dtype_for` answers bfloat16, so both trainers load the
  base in bf16 with NF4 compute dtype bf16, as on an H100/H200;
- `bf16=True` in both configs, so accelerate runs the forwards under (CPU) autocast, as it does on the GPU.

Bytes are those of torch's CPU allocator, read from `torch.profiler` memory events (every allocation and free,
with a timestamp): the live total at the start of training (counted from the live tensors: the model, its 4-bit
weights and quantization statistics) plus the running sum of the events. A phase's peak is the largest live total
while that phase's function runs (outermost phase wins when they nest); `other` is everything outside the named
phases (the optimizer step, logging). The first step allocates the optimizer state; peaks are over all steps.

`--variant` runs grpo-lab with one change, to attribute bytes to a cause (see VARIANTS); `--trainers` picks the
runs. CPU figures differ from `torch.cuda.max_memory_allocated` in kernels' workspaces (attention, cuBLAS) and
the caching allocator's rounding, not in which tensors are alive. peft's LoRA layers ask `torch.is_autocast_enabled()`
without a device, which answers for CUDA only; the bf16 emulation makes it answer for the CPU, so that a LoRA layer
skips its input cast under autocast as it does on a GPU. `proposed_estimate` is the memory formula these figures
check (printed beside them).

Since e80dafc both fixes the variants prototyped are grpo-lab's own code (`05_models`: no fp32 upcast of a 4-bit
base; `03_loss`: the head's input taken by a pre-hook): `main` measures them, and the figures in BENCHMARKS.md give the
state before (tree 42c9f08).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from grpo_lab import bench

PHASES = {"grpo-lab": {"generation": "_completions", "scoring": "_score", "logps (no grad)": "_add_logps",
                       "loss forward": "_micro_batch_loss"},
          "trl": {"generation": "_generate", "scoring": "_calculate_rewards",
                  "logps (no grad)": "_get_per_token_logps_and_entropies", "loss forward": "compute_loss"}}
ORDER = ("start", "generation", "scoring", "logps (no grad)", "loss forward", "backward", "other")

VARIANTS = {
    "main": "grpo-lab as it is",
    "no-upcast": "prepare_model_for_kbit_training without its fp32 upcast: embeddings, norms and LM head stay bf16 "
                 "(lm_head_logps casts the hidden states to the head's dtype, as the lead's change does)",
    "bf16-lora": "LoRA weights cast to bf16 after get_peft_model, as TRL 1.16 does for quantized models",
    "trl-dtypes": "both: no fp32 upcast and bf16 LoRA (TRL 1.16's dtypes)",
    "last-hidden": "no-upcast, and completion_logps reads the last hidden state from a hook on the final norm, "
                   "not output_hidden_states=True",
    "fix": "no-upcast, and completion_logps takes the final hidden states from a forward pre-hook on the LM head "
           "(which then gets an empty slice): no output_hidden_states, and the model's own head computes nothing",
}


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


# ---------------------------------------------------------------------------------------------- the child process
def _emulate_gpu_dtypes():
    "bf16 compute dtype and bf16 autocast on the CPU, as a bf16 GPU run has them."
    import torch
    from grpo_lab import bench, models
    models.compute_dtype_for = lambda device: torch.bfloat16
    cuda_only = torch.is_autocast_enabled      # peft asks it without a device; on a GPU that is the GPU's autocast
    torch.is_autocast_enabled = lambda device_type=None: cuda_only(device_type or "cpu")
    common = bench._common_args
    bench._common_args = lambda s, output_dir, cuda: {**common(s, output_dir, cuda), "bf16": True}


def _apply_variant(variant: str):
    "Monkeypatch grpo-lab for one `VARIANTS` entry (in this process only)."
    import torch
    from grpo_lab import loss, models
    if variant in ("no-upcast", "trl-dtypes", "last-hidden", "fix"):
        original = models._peft

        class _PeftNoUpcast:                       # peft, with prepare_model_for_kbit_training minus the fp32 cast
            def __getattr__(self, name):
                return getattr(original(), name)

            @staticmethod
            def prepare_model_for_kbit_training(model, use_gradient_checkpointing=True,
                                                gradient_checkpointing_kwargs=None):
                model.requires_grad_(False)
                if use_gradient_checkpointing:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
                    model.enable_input_require_grads()
                return model
        models._peft = lambda: _PeftNoUpcast()
        head_logps = loss.lm_head_logps        # a bf16 head meets hidden states that accelerate returned in fp32

        def lm_head_logps(hidden, weight, *args, **kwargs):
            return head_logps(hidden.to(weight.dtype), weight, *args, **kwargs)
        loss.lm_head_logps = lm_head_logps
    if variant in ("bf16-lora", "trl-dtypes"):
        prepare = models._prepare_for_training

        def prepare_bf16(*args, **kwargs):
            model = prepare(*args, **kwargs)
            for p in model.parameters():
                if p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
            return model
        models._prepare_for_training = prepare_bf16
    if variant == "last-hidden":
        def logps(model, input_ids, attention_mask, logits_to_keep, temperature=1.0, batch_size=None,
                  compute_entropy=False):
            head = loss._lm_head(model)
            norm = loss._unwrap(model).get_decoder().norm
            seen = {}
            handle = norm.register_forward_hook(lambda m, i, o: seen.__setitem__("h", o))
            try:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
                model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                      logits_to_keep=1)
            finally:
                handle.remove()
            return lm_head_logps(seen.pop("h")[:, -(logits_to_keep + 1):-1], *head,
                                 input_ids[:, -logits_to_keep:], temperature, compute_entropy)
        import grpo_lab.trainer as lab_trainer
        lab_trainer.completion_logps = logps
    if variant == "fix":
        def logps_fix(model, input_ids, attention_mask, logits_to_keep, temperature=1.0, batch_size=None,
                      compute_entropy=False):
            weight, bias = loss._lm_head(model)
            seen = {}

            def take_hidden(module, args):         # keep the head's input, give the head nothing to compute
                seen["h"] = args[0]
                return (args[0][..., :0, :],)
            handle = loss._unwrap(model).get_output_embeddings().register_forward_pre_hook(take_hidden)
            try:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
                model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                      logits_to_keep=logits_to_keep + 1)
            finally:
                handle.remove()
            return lm_head_logps(seen.pop("h")[:, :-1], weight, bias, input_ids[:, -logits_to_keep:], temperature,
                                 compute_entropy)
        import grpo_lab.trainer as lab_trainer
        lab_trainer.completion_logps = logps_fix


def _live_tensor_bytes() -> int:
    "Bytes of every distinct tensor storage reachable from Python objects now."
    import torch
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _model_bytes(model) -> dict:
    "The model's tensors by kind: 4-bit weights (+ their statistics), other frozen params by dtype, trainable."
    import torch
    parts, seen = {}, set()
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if type(p).__name__ == "Params4bit":
            key = "4-bit weights"
            state = getattr(p, "quant_state", None)
            extra = 0
            if state is not None:
                tensors = [state.absmax, getattr(state, "code", None)]
                if getattr(state, "state2", None) is not None:
                    tensors += [state.state2.absmax, state.state2.code, state.offset]
                extra = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            parts["4-bit statistics"] = parts.get("4-bit statistics", 0) + extra
        elif p.requires_grad:
            key = f"trainable {str(p.dtype).replace('torch.', '')}"
        else:
            key = f"frozen {str(p.dtype).replace('torch.', '')}"
        parts[key] = parts.get(key, 0) + p.numel() * p.element_size()
    return parts


def _optimizer_bytes(optimizer) -> int:
    import torch
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(v.numel() * v.element_size() for state in inner.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def _mark(fn, label: str, depth: list):
    "`fn` inside a profiler range named `phase:label`, unless another phase is already open."
    import torch

    def marked(*args, **kwargs):
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0] += 1
        try:
            with torch.profiler.record_function(f"phase:{label}"):
                return fn(*args, **kwargs)
        finally:
            depth[0] -= 1
    return marked


def _allocations(roots) -> list[tuple]:
    "Every CPU allocation and free in the profile: (time, bytes (< 0: freed), address, the ops around it)."
    out, stack = [], [(r, ()) for r in roots]
    while stack:
        node, chain = stack.pop()
        if node.name == "[memory]":
            f = node.extra_fields
            if f.device.type == "cpu":
                out.append((node.start_time_ns, f.alloc_size, f.ptr, chain))
            continue
        keep = node.name.startswith(("phase:", "aten::", "autograd::")) or "Backward" in node.name
        stack.extend((child, chain + (node.name,) if keep else chain) for child in node.children)
    return sorted(out, key=lambda e: e[0])


def _phase(chain: tuple) -> str:
    return next((c[6:] for c in chain if c.startswith("phase:")), "other")


def _describe(chain: tuple) -> str:
    "Where an allocation was made: its phase, and its outermost and innermost ops."
    ops = [c for c in chain if not c.startswith("phase:")]
    return f"{_phase(chain)}: " + (" > ".join(dict.fromkeys([ops[0], ops[-1]])) if ops else "?")


def _peaks(allocations, start_bytes: int) -> dict:
    "The largest live total while each phase ran (live tensors at the start + the running sum of events)."
    peaks, live = {"start": start_bytes}, start_bytes
    for _, nbytes, _, chain in allocations:
        live += nbytes
        phase = _phase(chain)
        peaks[phase] = max(peaks.get(phase, 0), live)
    return {"peak": peaks, "final": live}


def _live_at_peaks(allocations, figures: dict, start_bytes: int, top: int = 16) -> dict:
    "At each phase's peak, the largest groups of allocations made since training started and alive then."
    targets = {phase: value for phase, value in figures["peak"].items() if phase != "start"}
    live, total, found = {}, start_bytes, {}
    for _, nbytes, ptr, chain in allocations:
        if nbytes > 0:
            live[ptr] = (nbytes, chain)
        else:
            live.pop(ptr, None)
        total += nbytes
        phase = _phase(chain)
        if phase not in found and targets.get(phase) == total:
            groups = {}
            for size, where in live.values():
                key = (_describe(where), size)
                groups[key] = groups.get(key, 0) + 1
            rows = sorted(groups.items(), key=lambda kv: -kv[0][1] * kv[1])[:top]
            by_phase = {}
            for size, where in live.values():
                by_phase[_phase(where)] = by_phase.get(_phase(where), 0) + size
            found[phase] = [f"{n} x {size / 2**20:.2f} MiB  {where}" for (where, size), n in rows] + [
                "alive, by the phase that made it: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in by_phase.items())]
    return found


def run_child(kind: str, workdir: Path, variant: str, dtype: str, explain: bool = False) -> dict:
    "Build one trainer as `grpo-lab bench` does, train it under the profiler, and return its memory figures."
    import torch
    from datasets import Dataset
    from torch.profiler import ProfilerActivity, profile
    from grpo_lab import bench
    if dtype == "bfloat16":
        _emulate_gpu_dtypes()
    if kind == "grpo-lab":
        _apply_variant(variant)
    s = bench.BenchSettings(**json.loads((workdir / "settings.json").read_text()))
    torch.set_num_threads(s.threads or 1)
    dataset = Dataset.from_dict({"prompt": json.loads((workdir / "prompts.json").read_text())})
    trainer = bench._make_trainer(kind, s, workdir / "model", dataset, str(workdir / f"out-{kind}"))
    import grpo_lab.trainer as lab_trainer
    owner, depth = (lab_trainer if kind == "grpo-lab" else trainer), [0]
    for label, name in PHASES[kind].items():
        setattr(owner, name, _mark(getattr(owner, name), label, depth))
    trainer.accelerator.backward = _mark(trainer.accelerator.backward, "backward", depth)
    model = trainer.model
    loaded = _model_bytes(model)
    gc.collect()
    start = _live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train()
    allocations = _allocations(prof.profiler.kineto_results.experimental_event_tree())
    figures = _peaks(allocations, start)
    if explain:
        figures["explain"] = _live_at_peaks(allocations, figures, start)
    first = next(p for p in model.parameters() if p.dtype.is_floating_point and not p.requires_grad)
    return {"trainer": kind, "variant": variant if kind == "grpo-lab" else "-", "dtype": dtype, **figures,
            "model": loaded, "optimizer_state": _optimizer_bytes(trainer.optimizer),
            "frozen_float_dtype": str(first.dtype), "settings": asdict(s)}


# ----------------------------------------------------------------------------------------------- the estimates
def proposed_estimate(settings, upcast: bool, head_copies: str = "none", prefill_rows: int | None = None,
                      lora_bytes: int = 16, dtype_bytes: int = 2) -> dict:
    """Peak bytes of a LoRA-on-4-bit GRPO step by phase (gradient checkpointing off), the formula this script checks.

    `upcast`: peft's prepare_model_for_kbit_training left embeddings/norms/head in fp32 (grpo-lab main), so the
    residual stream and most saved activations are fp32. `head_copies`: what the model's own LM head costs in the
    loss forward when only its last position is kept: "cast" (one compute-dtype copy of an fp32 head, autocast),
    "rows" (aten::matmul's expand path: one copy of the head per row, for a strided (B, 1, H) input), "none".
    `prefill_rows`: rows whose prompt goes through the head at once in generation (grpo-lab's shared prefill: one per
    prompt; TRL: every row). `lora_bytes` per LoRA weight: 16 (fp32 weight, gradient, two Adam moments), TRL's bf16: 8.
    """
    from grpo_lab.memory import _Shapes, model_config
    from grpo_lab import bench
    from grpo_lab.loss import LM_HEAD_TILE_ELEMENTS
    config = model_config(bench.SHAPES[settings.shape])
    if settings.layers:
        config.num_hidden_layers = settings.layers
    x, b = _Shapes.of(config), dtype_bytes
    rows = settings.per_device_train_batch_size
    unique = rows // settings.num_generations
    tokens = rows * (settings.prompt_length + settings.completion_length)
    head = x.vocab * x.hidden
    weights = (x.layers * x.linear_per_layer * (0.5 + 1 / 64 + 4 / (64 * 256))
               + (x.embeddings + x.other) * (4 if upcast else b))
    lora = x.lora_parameters(settings.lora_r) * lora_bytes
    # saved for backward, per token and layer (measured: 290 MiB a layer at 3,072 tokens, grpo-lab [fix] and TRL
    # alike): the MLP's gate, SiLU(gate), up and their product (4 I values), and about 9 h values' worth around
    # attention (the two norms' fp32 copies of the residual, q/k/v after rotary, the attention output, ...)
    per_token_layer = (9 * x.hidden + 4 * x.intermediate) * b
    if upcast:   # fp32 residuals and MLP outputs, bf16 copies where autocast casts them for the LoRA and bnb matmuls
        per_token_layer = 28 * x.hidden + 14 * x.intermediate
    activations = tokens * x.layers * per_token_layer
    tile = min(LM_HEAD_TILE_ELEMENTS, rows * settings.completion_length * x.vocab)
    tiles = 5 * tile * 4                                      # one tile's recomputed logits and their gradients
    transient = {"cast": head * b, "rows": rows * head * b, "none": 0}[head_copies]
    kv_cache = rows * (settings.prompt_length + settings.completion_length) * x.layers * 2 * x.kv_heads * x.head_dim * \
        (4 if upcast else b)
    prefill_head = head * b if upcast else (prefill_rows or unique) * head * b   # head copies, strided rows
    fixed = weights + lora
    training = activations + max(transient, tiles)            # the head's copies come and go before the tiles
    return {"start": weights + x.lora_parameters(settings.lora_r) * lora_bytes // 4, "generation": fixed + kv_cache + prefill_head,
            "loss forward": fixed + training, "total": fixed + max(kv_cache + prefill_head, training)}


# --------------------------------------------------------------------------------------------------- the parent
def prepare(settings, workdir: Path):
    "The shared model folder, prompts and settings (as `grpo-lab bench` writes them)."
    from grpo_lab import bench
    bench.prepare_model(settings, workdir / "model")
    tokenizer = bench.load_tokenizer(workdir / "model")
    unique = settings.per_device_train_batch_size * settings.gradient_accumulation_steps // settings.num_generations
    prompts = bench.synthetic_prompts(tokenizer, unique * settings.steps, settings.prompt_length, settings.seed)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    (workdir / "settings.json").write_text(json.dumps(asdict(settings)))


def run(kind: str, variant: str, workdir: Path, dtype: str, explain: bool = False) -> dict:
    out = workdir / f"{kind}-{variant}.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, __file__, "--child", kind, "--variant", variant, "--workdir", str(workdir),
                        "--out", str(out), "--dtype", dtype] + (["--explain"] if explain else []),
                       capture_output=True, text=True, env=env)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"the {kind} ({variant}) run failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    return json.loads(out.read_text())


ESTIMATE_ARGS = {"main": dict(upcast=True, head_copies="cast"), "no-upcast": dict(upcast=False, head_copies="rows"),
                 "bf16-lora": dict(upcast=True, head_copies="cast", lora_bytes=8),
                 "trl-dtypes": dict(upcast=False, head_copies="rows", lora_bytes=8),
                 "last-hidden": dict(upcast=False, head_copies="rows"), "fix": dict(upcast=False, head_copies="none")}


def estimate_table(settings, results: list[dict]) -> str:
    "The proposed formula next to the measured peaks, and what `estimate_memory` says today."
    from grpo_lab.memory import estimate_memory, model_config
    config = model_config(bench.SHAPES[settings.shape])
    if settings.layers:
        config.num_hidden_layers = settings.layers
    today = estimate_memory(config, load_in_4bit=settings.load_in_4bit, lora_r=settings.lora_r,
                            num_generations=settings.num_generations,
                            per_device_train_batch_size=settings.per_device_train_batch_size,
                            max_prompt_length=settings.prompt_length, max_completion_length=settings.completion_length,
                            gradient_checkpointing=settings.gradient_checkpointing).total * 2**30
    lines = [f"estimate_memory today: {_mib(today).strip()} MiB; the proposed formula (proposed_estimate), MiB:",
             f"{'run':<24}{'generation':>24}{'loss forward':>24}{'overall peak':>24}   (estimate / measured)"]
    for r in results:
        kwargs = (dict(upcast=False, head_copies="none", prefill_rows=settings.per_device_train_batch_size,
                       lora_bytes=8) if r["trainer"] == "trl" else ESTIMATE_ARGS[r["variant"]])
        e = proposed_estimate(settings, **kwargs)
        measured = {"generation": r["peak"].get("generation", 0), "loss forward": max(
            r["peak"].get("loss forward", 0), r["peak"].get("backward", 0)), "total": max(r["peak"].values())}
        name = r["trainer"] + ("" if r["variant"] in ("-", "main") else f" [{r['variant']}]")
        lines.append(f"{name:<24}" + "".join(f"{e[k] / 2**20:>10.0f} / {measured[k] / 2**20:<11.0f}"
                                             for k in ("generation", "loss forward", "total")))
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    "Peak MiB per phase, one row per run."
    cols = [c for c in ORDER if any(c in r["peak"] for r in results)]
    lines = [f"{'run':<24}" + "".join(f"{c:>17}" for c in cols) + f"{'overall peak':>17}"]
    for r in results:
        name = r["trainer"] + ("" if r["variant"] in ("-", "main") else f" [{r['variant']}]")
        lines.append(f"{name:<24}" + "".join(f"{_mib(r['peak'][c]) if c in r['peak'] else '-':>17}" for c in cols)
                     + f"{_mib(max(r['peak'].values())):>17}")
    lines.append("start = live tensors when training starts (model, 4-bit statistics); MiB, peak live total per phase")
    for r in results:
        name = r["trainer"] + ("" if r["variant"] in ("-", "main") else f" [{r['variant']}]")
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in sorted(r["model"].items()))
        lines.append(f"  {name}: model MiB: {parts}; optimizer state {r['optimizer_state'] / 2**20:.1f}; "
                     f"frozen float params {r['frozen_float_dtype']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--child", choices=["grpo-lab", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--variant", default="main", choices=list(VARIANTS), help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="compute dtype to emulate (bfloat16: as on a bf16 GPU; float32: the CPU's own)")
    p.add_argument("--variants", nargs="+", default=["main"], choices=list(VARIANTS),
                   help="grpo-lab runs: " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items()))
    p.add_argument("--trainers", nargs="+", default=["grpo-lab", "trl"], choices=["grpo-lab", "trl"])
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--explain", action="store_true",
                   help="also list, at each phase's peak, the largest allocations alive then (slower)")
    for action in bench.add_bench_arguments(argparse.ArgumentParser())._actions[1:]:
        if action.dest not in {"repeats", "output_dir", "trl_python", "no_trl", "quiet"}:
            p._add_action(action)
    p.set_defaults(steps=2)
    a = p.parse_args(argv)
    if a.child:
        Path(a.out).write_text(json.dumps(run_child(a.child, Path(a.workdir), a.variant, a.dtype, a.explain)))
        return 0
    settings = bench.settings_from_args(a)
    print(settings.describe() + f"; compute dtype {a.dtype}" + (" with autocast" if a.dtype == "bfloat16" else ""))
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-lab-memory-") as workdir:
        prepare(settings, Path(workdir))
        for kind in a.trainers:
            for variant in (a.variants if kind == "grpo-lab" else ["main"]):
                results.append(run(kind, variant, Path(workdir), a.dtype, a.explain))
                print(f"done: {kind} {variant}", file=sys.stderr, flush=True)
    print(table(results))
    if settings.load_in_4bit and settings.lora_r and not settings.gradient_checkpointing:
        print(estimate_table(settings, results))
    for r in results:
        for phase, rows in r.get("explain", {}).items():
            print(f"{r['trainer']} [{r['variant']}] at the {phase} peak ({_mib(r['peak'][phase]).strip()} MiB), "
                  "largest allocations alive (count x size, where made):")
            print("\n".join("    " + row for row in rows))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
