"""The multiplication toy (grpo_lab.tools): held-out tool use before and after a short GRPO run with tools=[multiply].

Issue 21 asks whether GRPO teaches a small chat model to use a calculator on 3-digit x 2-digit products, which it
cannot compute in its head. For each seed this script measures, on held-out problems (none of the training pairs),
the rate of rollouts that call the tool, the share of calls that are well formed, and the accuracy with and without
a call; then trains `--steps` GRPO steps with `product_reward` (and, with `--call-bonus`, a reward for a well-formed
call) and measures again. It prints one JSON line per seed.

    python benchmarks/tool_toy.py --seeds 0 1 2 --steps 20                   # SmolLM2-135M-Instruct, offline, CPU
    python benchmarks/tool_toy.py --warm-start 20 --steps 10                 # a supervised warm start first
    python benchmarks/tool_toy.py --model Qwen/Qwen2.5-0.5B-Instruct --steps 50 --seeds 0 1 2   # hub, GPU
"""
import argparse, json, tempfile, time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.models import smollm2_path
from grpo_lab.rollout import SamplingSettings
from grpo_lab.tools import (ToolLoopEngine, final_answer, multiply, multiplication_problems, product_reward,
                            tool_suffix_ids, tool_use_stats)


def well_formed_call(completions, **kwargs) -> list[float]:
    "0.5 for a rollout whose tool calls all ran (a shaping reward for a model that never calls: `--call-bonus`)."
    return [0.5 if any(m["role"] == "tool" and not m["content"].startswith('{"error"') for m in c) else 0.0
            for c in completions]


def switched_off(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    raise RuntimeError("the calculator is switched off; answer without it")

switched_off.__name__ = "multiply"      # the same tool as the model sees it, answering every call with an error


def rollouts(model, tokenizer, problems, max_new_tokens: int, tool=multiply, batch: int = 16) -> list[list[dict]]:
    "One rollout per problem (temperature 1, one round of calls): each rollout's messages."
    engine = ToolLoopEngine(tokenizer, tools=[tool], max_tool_calling_iterations=1)
    settings = SamplingSettings(max_new_tokens=max_new_tokens, eos_token_ids=[tokenizer.eos_token_id],
                                pad_token_id=tokenizer.pad_token_id)
    messages = []
    for i in range(0, len(problems), batch):
        rows = problems[i:i + batch]
        messages += engine.generate(rows, torch.arange(len(rows)), model, settings, 0).extra["completion_messages"]
    return messages


def held_out_stats(model, tokenizer, problems, max_new_tokens: int) -> dict:
    "Tool-use figures on `problems`, and the accuracy when the calculator answers every call with an error."
    answers = [r["answer"] for r in problems]
    messages = rollouts(model, tokenizer, problems, max_new_tokens)
    off = rollouts(model, tokenizer, problems, max_new_tokens, tool=switched_off)
    return {**tool_use_stats(messages, answers), "accuracy_tool_off": product_reward(off, answers).count(1.0) / len(off),
            "sample": messages[0]}


def warm_start(model, tokenizer, problems, steps: int, batch: int = 4, learning_rate: float = 1e-4) -> list[float]:
    "A few supervised steps on ideal transcripts (call, result, answer); the tool's tokens are not trained. Losses."
    engine = ToolLoopEngine(tokenizer, tools=[multiply])
    examples = []
    for r in problems:
        prompt = tokenizer(engine.render(r["prompt"], [multiply], SamplingSettings()), add_special_tokens=False)["input_ids"]
        call = tokenizer('<tool_call>\n{"name": "multiply", "arguments": {"a": %d, "b": %d}}\n</tool_call><|im_end|>'
                         % (r["a"], r["b"]), add_special_tokens=False)["input_ids"]
        result = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "multiply", "content": str(r["answer"])}],
                                 engine.chat_template)
        answer = tokenizer(f"{r['a']} times {r['b']} is {r['answer']}.<|im_end|>", add_special_tokens=False)["input_ids"]
        ids = prompt + call + result + answer
        labels = [-100] * len(prompt) + call + [-100] * len(result) + answer
        examples.append((ids, labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    losses = []
    for step in range(steps):
        chunk = [examples[(step * batch + i) % len(examples)] for i in range(batch)]
        width = max(len(ids) for ids, _ in chunk)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in chunk])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in chunk])
        mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in chunk])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(round(loss.item(), 3))
    return losses


def run_seed(model_name: str, seed: int, steps: int, n_train: int, n_eval: int, max_new_tokens: int,
             call_bonus: bool, warm_steps: int = 0) -> dict:
    torch.manual_seed(seed)
    train = multiplication_problems(n_train, seed=seed)
    held = multiplication_problems(n_eval, seed=1000 + seed, exclude={(r["a"], r["b"]) for r in train})
    tokenizer = AutoTokenizer.from_pretrained(model_name)
    model = AutoModelForCausalLM.from_pretrained(model_name)
    record = {"model": model_name, "seed": seed, "steps": steps}
    if warm_steps:
        record["base"] = held_out_stats(model, tokenizer, held, max_new_tokens)
        record["warm_start_losses"] = warm_start(model, tokenizer, train, warm_steps)
    record["before"] = held_out_stats(model, tokenizer, held, max_new_tokens)
    if steps:
        args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_generations=8,
                          max_completion_length=max_new_tokens, max_tool_calling_iterations=1, max_steps=steps,
                          learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none", seed=seed,
                          disable_tqdm=True)
        rewards = [product_reward, well_formed_call] if call_bonus else product_reward
        trainer = GRPOTrainer(model, rewards, args=args, train_dataset=Dataset.from_list(train),
                              processing_class=tokenizer, tools=[multiply])
        start = time.perf_counter()
        trainer.train()
        record["seconds_per_step"] = round((time.perf_counter() - start) / steps, 1)
        record["call_frequency_per_step"] = [h.get("tools/call_frequency") for h in trainer.history]
        record["after"] = held_out_stats(trainer.accelerator.unwrap_model(trainer.model), tokenizer, held, max_new_tokens)
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder or hub id (default: SmolLM2-135M-Instruct, built offline)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=0, help="GRPO steps (0: measure only)")
    p.add_argument("--train", type=int, default=64, help="training problems")
    p.add_argument("--eval", type=int, default=32, help="held-out problems")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--call-bonus", action="store_true", help="add 0.5 for a rollout whose calls ran")
    p.add_argument("--warm-start", type=int, default=0, help="supervised steps on ideal transcripts before GRPO")
    a = p.parse_args(argv)
    model = a.model or str(smollm2_path())
    for seed in a.seeds:
        print(json.dumps(run_seed(model, seed, a.steps, a.train, a.eval, a.max_new_tokens, a.call_bonus,
                                  a.warm_start)), flush=True)


if __name__ == "__main__":
    main()
