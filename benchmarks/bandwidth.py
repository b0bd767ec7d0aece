"""The memory-bandwidth bound of decoding on this machine: copy and read bandwidth, and the tokens/s it allows.

Each decode step of a batch reads every weight once, and the KV cache of every sequence in the batch (B x `--context`
cached tokens on average), so one step cannot be faster than (those bytes) / (read bandwidth), and a batch of B
sequences decodes at most B x bandwidth / bytes tokens per second. Prints one JSON line per model shape and dtype with that bound next to the
measured bandwidth (median of `--repeats`, `--threads` torch threads, a 1 GiB buffer, far beyond the caches):

    python benchmarks/bandwidth.py --threads 2 --batch 64 16
"""
import argparse, json, os, statistics, time


def bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> dict:
    "GB/s of a tensor copy (bytes read + written) and of a sum (bytes read), median of `repeats`."
    import torch
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a), a.sum()                                      # touch every page first
    copy, read = [], []
    for _ in range(repeats):
        t = time.perf_counter(); b.copy_(a); copy.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter(); a.sum(); read.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    return {"copy_GBps": round(statistics.median(copy), 2), "read_GBps": round(statistics.median(read), 2)}


def weight_bytes(config, bytes_per_value: int) -> int:
    "Bytes of weights read per decode step: every parameter once, and a tied embedding again as the output layer."
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())      # tied weights are counted once here
    if getattr(config, "tie_word_embeddings", False):
        params += model.get_input_embeddings().weight.numel()   # ... and read twice: lookup is tiny, the head is not
        params -= config.hidden_size                             # the lookup reads one row per token
    return params * bytes_per_value


def kv_bytes_per_token(config, bytes_per_value: int) -> int:
    "Bytes of keys and values one cached token holds (every layer)."
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * heads * head_dim * bytes_per_value


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 16])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--context", type=int, default=70, help="cached tokens per sequence, on average over the decode")
    a = p.parse_args(argv)
    from transformers import AutoConfig
    from grpo_lab.memory import model_config
    from grpo_lab.models import smollm2_path
    bw = bandwidth(a.threads, repeats=a.repeats)
    print(json.dumps({"threads": a.threads, **bw, "load_average": os.getloadavg()}), flush=True)
    shapes = {"smollm2": AutoConfig.from_pretrained(smollm2_path()), "qwen2.5-0.5b": model_config("Qwen2.5-0.5B-Instruct")}
    for name, config in shapes.items():
        for dtype, size in (("float32", 4), ("bfloat16", 2)):
            weights, kv = weight_bytes(config, size), kv_bytes_per_token(config, size) * a.context
            bound = {}
            for b in a.batch:
                step = (weights + b * kv) / (bw["read_GBps"] * 1e9)
                bound[f"batch{b}_min_step_ms"], bound[f"batch{b}_max_tokens_per_s"] = round(step * 1e3, 1), round(b / step)
            print(json.dumps({"model": name, "dtype": dtype, "weight_MB_per_step": round(weights / 1e6, 1),
                              "kv_MB_per_sequence": round(kv / 1e6, 2), **bound}), flush=True)


if __name__ == "__main__":
    main()
