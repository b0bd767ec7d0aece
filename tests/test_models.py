"""The shipped tiny model, policy loading (full, 4-bit + LoRA), the reference policy, and memory estimates."""
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.loss import completion_logps
from grpo_lab.memory import estimate_memory
from grpo_lab.models import (greedy_accuracy, load_policy, make_reference, reference_logps, tiny_eval_problems,
                             tiny_model_path, tiny_model_task)


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(tiny_model_path()), AutoTokenizer.from_pretrained(tiny_model_path())


@pytest.fixture
def batch(tiny):
    enc = tiny[1](["12+34=46", "50-7=43", "9+9=18"], return_tensors="pt", padding=True)
    return enc.input_ids, enc.attention_mask


def test_shipped_files_are_small_and_complete():
    files = {p.name: p.stat().st_size for p in tiny_model_path().iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "grpo_lab_task.json"} <= set(files)
    assert sum(files.values()) <= 5 * 10**6


def test_shipped_model_accuracy_in_range(tiny):
    model, tokenizer = tiny
    task = tiny_model_task()
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id == tokenizer.eos_token_id
    accuracy = greedy_accuracy(model, tokenizer, tiny_eval_problems(300), max_new_tokens=task["max_new_tokens"])
    assert 0.15 <= accuracy <= 0.3, accuracy   # warm-started to a validation accuracy of 0.2
    assert abs(accuracy - task["greedy_accuracy"]) < 0.08


def test_chat_prompts_render_like_plain_ones(tiny):
    model, tokenizer = tiny
    problems = tiny_eval_problems(40)
    chats = [[{"role": "user", "content": p}] for p in problems["prompt"]]
    assert greedy_accuracy(model, tokenizer, chats, problems["answer"], max_new_tokens=5) == \
        greedy_accuracy(model, tokenizer, problems, max_new_tokens=5)


def test_qlora_on_cpu_trains_only_adapters(batch):
    import bitsandbytes as bnb
    model, _ = load_policy(tiny_model_path(), load_in_4bit=True, lora_r=8)
    linears = [m for n, m in model.named_modules() if n.endswith("q_proj.base_layer") or n.endswith("down_proj.base_layer")]
    assert linears and all(isinstance(m, bnb.nn.Linear4bit) for m in linears)
    base = linears[0].weight.data.clone()
    ids, mask = batch
    before = reference_logps(model, None, ids, mask, 3)
    model.eval()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)  # eval-mode pass first
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    (-completion_logps(model, ids, mask, 3)[0].mean()).backward()
    with_grad = [n for n, p in model.named_parameters() if p.grad is not None]
    assert with_grad and all("lora_" in n for n in with_grad)
    optimizer.step()
    policy = completion_logps(model, ids, mask, 3)[0].detach()
    reference = reference_logps(model, None, ids, mask, 3)
    assert torch.allclose(reference, before, atol=1e-5)
    assert (policy - reference).abs().max() > 1e-3
    assert torch.equal(base, linears[0].weight.data)
    assert make_reference(model, beta=0.04) is None


def test_full_finetuning_reference_is_a_frozen_copy(batch):
    model, _ = load_policy(tiny_model_path())
    reference = make_reference(model, beta=0.04)
    frozen = {n: p.clone() for n, p in reference.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask = batch
    model.train()
    (-completion_logps(model, ids, mask, 3)[0].mean()).backward()
    optimizer.step()
    assert all(torch.equal(p, frozen[n]) for n, p in reference.named_parameters())
    assert not torch.equal(model.lm_head.weight, reference.lm_head.weight)
    assert (reference_logps(model, reference, ids, mask, 3) - completion_logps(model, ids, mask, 3)[0]).abs().max() > 1e-3
    assert make_reference(model, beta=0.0) is None


def test_missing_local_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy("./models/not-here")


def test_offline_hub_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set.*huggingface-cli download"):
        load_policy("grpo-lab-tests/no-such-model")


def test_4bit_bad_configurations(monkeypatch):
    with pytest.raises(ValueError, match="load_in_4bit=True with lora_r=None"):
        load_policy(tiny_model_path(), load_in_4bit=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with pytest.raises(ValueError, match="cannot be quantized"):
        load_policy(model, load_in_4bit=True, lora_r=8)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match="needs bitsandbytes.*drop load_in_4bit"):
        load_policy(tiny_model_path(), load_in_4bit=True, lora_r=8)


def test_memory_estimate_for_qwen_on_a_t4():
    t4 = dict(num_generations=8, per_device_train_batch_size=8, max_prompt_length=256, max_completion_length=256)
    qlora = estimate_memory("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True, lora_r=16, gradient_checkpointing=True, **t4)
    bf16 = estimate_memory("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=False, lora_r=16, gradient_checkpointing=True, **t4)
    no_ckpt = estimate_memory("Qwen/Qwen2.5-1.5B-Instruct", load_in_4bit=True, lora_r=16, gradient_checkpointing=False, **t4)
    assert 1.0 < qlora.weights < bf16.weights < 3.5   # 1.54B weights: ~2.9 GiB in bf16
    assert qlora.activations < no_ckpt.activations
    assert 2 < qlora.total < 15 and qlora.total == qlora["total"]
    assert qlora.lora_and_optimizer < 1 and qlora.kv_cache < 1
    assert "weights" in repr(qlora)


def test_linear_module_names_of_a_peft_model_are_the_plain_models():
    """A LoRA-wrapped model lists the layers `target_modules` may name, as the plain model does: the wrapped layers by
    their own names, no adapter key ('default') and no PEFT wrapper ('base_layer', 'original_module')."""
    from peft import LoraConfig, get_peft_model
    from grpo_lab.models import linear_module_names
    plain = linear_module_names(AutoModelForCausalLM.from_pretrained(tiny_model_path()))
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path()),
                          LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                                     task_type="CAUSAL_LM"))
    assert plain == ["down_proj", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert linear_module_names(lora) == plain
