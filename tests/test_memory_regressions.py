"""The two causes of issue 30's QLoRA memory gap (15.6 GB against TRL's 9.4 at Qwen2.5-1.5B), kept from coming back.

Measured on the CPU with `torch.profiler` (every allocation and free; the peak is the running sum), as
benchmarks/memory_phases.py does at full scale:

1. A 4-bit base must keep its embeddings and norms in the dtype they were loaded in. peft's
   `prepare_model_for_kbit_training` upcast them to float32, which made the residual stream float32: every saved
   activation twice the size, and a float32 LM head (+6 GB at 1.5B).
2. The log-probs must not make torch copy the LM head once per row. `model(..., logits_to_keep=1)` hands the head a
   strided `(B, 1, H)` input, and matmul then expands the head's weight to `(B, V, H)`: 7 GB at 16 rows and Qwen's
   vocabulary once the head is bf16.
"""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from grpo_lab.loss import completion_logps
from grpo_lab.models import random_tiny_model

pytest.importorskip("bitsandbytes")


def peak_bytes(fn) -> int:
    "The largest total of CPU bytes allocated (and not yet freed) while `fn` ran."
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.name == "[memory]" and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def test_the_head_is_never_copied_per_row():
    "16 rows, a 32k vocabulary: the log-probs' peak stays far below one head copy per row (16 x 4 MiB in bf16)."
    # one completion token per row: the tiles hold 16 x 32k logits (~6 MiB), a per-row copy of the head 62 MiB
    import peft      # the copy shows on a LoRA model (the QLoRA case): peft's layers hand the head a strided input
    base = random_tiny_model(vocab_size=32_000, hidden_size=64, num_hidden_layers=1).to(torch.bfloat16)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules="all-linear"))
    head_bytes = base.lm_head.weight.numel() * 2
    input_ids = torch.randint(32_000, (16, 24))
    mask = torch.ones_like(input_ids)
    peak = peak_bytes(lambda: completion_logps(model, input_ids, mask, logits_to_keep=1, compute_entropy=True))
    assert peak < 4 * head_bytes, f"peak {peak / 2**20:.1f} MiB for a {head_bytes / 2**20:.1f} MiB head"


def test_a_4bit_base_keeps_its_loaded_dtype(tmp_path):
    "grpo-lab's load_in_4bit and TRL's quantization_config both leave the embeddings and norms in bf16."
    from transformers import BitsAndBytesConfig
    from grpo_lab.models import load_policy, tiny_model_path
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    for kwargs in ({"load_in_4bit": True}, {"quantization_config": nf4}):
        model, _ = load_policy(tiny_model_path(), lora_r=4, torch_dtype=torch.bfloat16, **kwargs)
        frozen = {p.dtype for n, p in model.named_parameters()
                  if not p.requires_grad and p.dtype.is_floating_point}
        assert frozen == {torch.bfloat16}, (kwargs, frozen)
        assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
        seen = []
        head = model.get_output_embeddings()
        handle = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7]]))
        handle.remove()
        assert seen == [torch.bfloat16], (kwargs, seen)      # the residual stream stays bf16
