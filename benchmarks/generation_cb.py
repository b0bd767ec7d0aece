"""Generation back-ends on CPU: padded `generate`, grpo-lab's shared prefill, transformers' continuous batching.

Issue 9 asks whether transformers' continuous batching (`model.generate_batch`, what TRL's
`use_transformers_continuous_batching` calls) beats padded `generate` on CPU. This script times the three ways
grpo-lab could sample one generation batch, on the benchmark's shapes (`grpo_lab.bench.prepare_model`), alternating
them round by round so that machine drift hits all three, and prints the median seconds and tokens per second.

    python benchmarks/generation_cb.py --shape tiny --prompts 4 -G 4 --prompt-length 16 --completion-length 16
    python benchmarks/generation_cb.py --shape qwen2.5-0.5b --layers 2 --prompts 2 -G 4 --prompt-length 32 \\
        --completion-length 16

Sampling is temperature 1 (no top-k/top-p), the trainer's default. Tokens counted are the tokens each back-end
generated up to and including EOS (the random-weight shapes almost never sample EOS, so they run to the limit).
"""
import argparse, json, statistics, tempfile, time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from grpo_lab.bench import BenchSettings, load_tokenizer, prepare_model, synthetic_prompts
from grpo_lab.rollout import sample_completions, tokenize_prompts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompts", type=int, default=2, help="unique prompts per generation batch")
    p.add_argument("-G", "--num-generations", type=int, default=4)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the three back-ends; the first is warm-up")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the per-round figures here")
    p.add_argument("--cb-config", default='{"max_memory_percent": 0.5}',
                   help="ContinuousBatchingConfig as JSON (default: TRL 1.16's training default; '{}' for transformers' own)")
    p.add_argument("--persistent", action="store_true",
                   help="keep the continuous-batching manager between calls (TRL starts one per call)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    settings = BenchSettings(shape=a.shape, layers=a.layers, prompt_length=a.prompt_length)
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare_model(settings, Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tok = load_tokenizer(folder)
    prompts = synthetic_prompts(tok, a.prompts, a.prompt_length, seed=0)
    texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]
    grouped = [t for t in texts for _ in range(a.num_generations)]       # each prompt G times, grouped
    prompt_ids, prompt_mask, _ = tokenize_prompts(tok, grouped)           # left-padded, as the trainer does
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]   # unpadded, for generate_batch
    eos = [tok.eos_token_id]
    gen = GenerationConfig(max_new_tokens=a.completion_length, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=eos, pad_token_id=tok.pad_token_id)

    def padded():
        c, m, _ = sample_completions(model, prompt_ids, prompt_mask, gen, eos, share_prefill=False)
        return int(m.sum())

    def shared():
        c, m, _ = sample_completions(model, prompt_ids, prompt_mask, gen, eos, share_prefill=True)
        return int(m.sum())

    from transformers.generation import ContinuousBatchingConfig
    cb_config = ContinuousBatchingConfig(**json.loads(a.cb_config))

    def continuous():
        with torch.no_grad():
            out = model.generate_batch(rows, generation_config=gen, continuous_batching_config=cb_config,
                                       progress_bar=False, persistent_manager=a.persistent)
        return sum(len(o.generated_tokens) for o in out.values())

    backends = {"padded generate": padded, "shared prefill": shared, "continuous batching": continuous}
    figures = {name: [] for name in backends}
    for r in range(a.rounds):
        for name, fn in backends.items():
            torch.manual_seed(r)
            t = time.perf_counter()
            try:
                tokens = fn()
            except Exception as e:      # report a back-end that cannot run here, keep timing the others
                figures[name].append({"error": f"{type(e).__name__}: {e}"})
                continue
            figures[name].append({"seconds": time.perf_counter() - t, "tokens": tokens})
    print(f"{a.shape}{f' ({a.layers} layers)' if a.layers else ''}: {a.prompts} prompts x G={a.num_generations}, "
          f"prompts {prompt_ids.size(1)} tokens, up to {a.completion_length} new, {torch.get_num_threads()} threads, "
          f"median of rounds 2-{a.rounds}; continuous batching config {a.cb_config}")
    base = None
    for name, runs in figures.items():
        ok = [f for f in runs[1:] if "seconds" in f]
        if not ok:
            print(f"  {name:20s} failed: {runs[-1].get('error')}")
            continue
        s = statistics.median(f["seconds"] for f in ok)
        tps = statistics.median(f["tokens"] / f["seconds"] for f in ok)
        base = base or s
        print(f"  {name:20s} {s:8.3f} s  {tps:8.1f} tokens/s  x{s / base:.2f} of padded generate")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "figures": figures}, indent=1))


if __name__ == "__main__":
    main()
