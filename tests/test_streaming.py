"""Training on a stream of prompts (`datasets.IterableDataset`): length from max_steps, order, epochs, resume."""
import json

import pytest
import torch
from datasets import IterableDataset

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer
from grpo_lab.steps import stream_chunks

TINY = str(tiny_model_path())


def small_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                learning_rate=1e-3, logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, save_strategy="no")
    return GRPOConfig(**{**base, **kw})


def stream(n: int) -> IterableDataset:
    "n arithmetic prompts as a stream that, like a hub stream, knows no length."
    rows = arithmetic_task(n).to_list()
    return IterableDataset.from_generator(lambda: iter(rows))


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def test_stream_chunks_keep_order_drop_the_tail_and_skip_on_resume():
    rows = [{"x": n} for n in range(10)]
    got = [(i, [r["x"] for r in c], last) for i, c, last in stream_chunks(rows, 4)]
    assert got == [(0, [0, 1, 2, 3], False), (1, [4, 5, 6, 7], True)]
    assert [(i, c[0]["x"]) for i, c, _ in stream_chunks(rows, 4, start=1)] == [(1, 4)]
    assert list(stream_chunks(rows, 11)) == []


def test_a_stream_without_max_steps_is_refused_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match=r"max_steps=-1.*set max_steps"):
        GRPOTrainer("no/such-model", exact_answer, args=small_args(tmp_path), train_dataset=stream(16))


def test_a_streamed_run_reads_prompts_in_order_and_restarts_the_stream(tmp_path):
    "shuffle_dataset=False: 10 prompts, 2 per step, so 5 steps per pass; 7 steps read it once and then again."
    seen = []

    def reward(prompts, completions, **kw):
        seen.extend(prompts[::4])
        return exact_answer(prompts, completions, **kw)

    trainer = GRPOTrainer(TINY, reward, args=small_args(tmp_path, max_steps=7, shuffle_dataset=False),
                          train_dataset=stream(10))
    out = trainer.train()
    order = list(arithmetic_task(10)["prompt"])
    assert out.global_step == trainer.plan.total_optimizer_steps == 7 and trainer.plan.dataset_size is None
    assert seen == order + order[:4]                                   # groups whole, in order, then the next pass
    assert [round(h["epoch"], 4) for h in trainer.history][4] == 1.0   # the pass ends with the stream


def test_an_unshuffled_stream_trains_exactly_as_the_same_prompts_in_a_dataset(tmp_path):
    "Same prompts, same order: the stream path and the Dataset path give the same logs and weights."
    kw = dict(max_steps=4, shuffle_dataset=False, gradient_accumulation_steps=2)
    streamed = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "s", **kw), train_dataset=stream(6))
    streamed.train()
    listed = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "d", **kw), train_dataset=arithmetic_task(6))
    listed.train()
    assert [h["reward"] for h in streamed.history] == [h["reward"] for h in listed.history]
    assert [h["epoch"] for h in listed.history] == [1.0, 2.0, 3.0, 4.0]        # 6 prompts, 4 per step: 1 step per pass
    a, b = weights(streamed), weights(listed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_a_shuffled_stream_mid_rollout_reproduces_the_uninterrupted_run(tmp_path):
    kw = dict(num_iterations=2, steps_per_generation=2, save_strategy="steps", save_steps=1, max_steps=11,
              learning_rate=5e-3)
    full = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "full", **kw), train_dataset=stream(10), lora_r=4)
    full.train()
    resumed = GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path / "resumed", **kw), train_dataset=stream(10),
                          lora_r=4)
    resumed.train(resume_from_checkpoint=tmp_path / "full" / "checkpoint-9")      # 2nd pass, mid-rollout
    assert [h["reward"] for h in resumed.history] == [h["reward"] for h in full.history]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    a, b = weights(full), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = [json.loads(l)["step"] for l in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 12)) + [11]      # every step once, then the run's summary



def test_a_streamed_prompt_too_long_for_the_model_is_refused_before_training(tmp_path):
    rows = arithmetic_task(5).to_list() + [{"prompt": "1" * 100, "answer": "1"}] + arithmetic_task(10).to_list()
    with pytest.raises(ValueError, match=r"prompt 5 has 100 tokens but the model reads at most 64 positions"):
        GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=2),
                    train_dataset=IterableDataset.from_generator(lambda: iter(rows)))


def test_a_finite_stream_can_be_the_eval_dataset(tmp_path):
    args = small_args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8)
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=stream(8), eval_dataset=stream(6))
    trainer.train()
    evaluated = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert len(evaluated) == 1 and 0 <= evaluated[0]["eval_reward"] <= 1

TWO_PROCESS_SCRIPT = '''
import json, sys
from datasets import IterableDataset
from grpo_lab.data import arithmetic_task
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer
from grpo_lab.trainer import GRPOConfig, GRPOTrainer

out, rows, result = sys.argv[1], arithmetic_task(12, seed=3).to_list(), {}
for name, data in [("stream", IterableDataset.from_generator(lambda: iter(rows))), ("dataset", arithmetic_task(12, seed=3))]:
    seen = []
    def reward(prompts, completions, **kw):
        seen.append(prompts)
        return exact_answer(prompts, completions, **kw)
    args = GRPOConfig(output_dir=f"{out}/{name}", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      num_generations=4, max_steps=4, shuffle_dataset=False, learning_rate=1e-3, max_completion_length=5,
                      logging_steps=1, save_strategy="no", disable_tqdm=True, gradient_checkpointing=False)
    trainer = GRPOTrainer(str(tiny_model_path()), reward, args=args, train_dataset=data)
    trainer.train()
    result[name] = {"seen": seen, "rewards": [h["reward"] for h in trainer.history]}
rank = trainer.accelerator.process_index
json.dump(result, open(f"{out}/rank{rank}.json", "w"))
'''


def test_two_processes_share_a_stream_as_they_share_a_dataset(tmp_path):
    "Each process generates for its own half of every generation batch, the same rows a Dataset would give it."
    from conftest import ROOT
    from test_scale import run_two_cpu_processes

    ranks = run_two_cpu_processes(tmp_path, TWO_PROCESS_SCRIPT, ROOT / "configs" / "tiny-cpu.yaml")
    prompts = list(arithmetic_task(12, seed=3)["prompt"])
    # 4 completions x 2 processes x 2 accumulation steps = 4 prompts per generation batch; rank 0 gets the first 2
    for rank, result in enumerate(ranks):
        assert result["stream"]["seen"] == result["dataset"]["seen"]
        assert result["stream"]["seen"][0] == [p for p in prompts[2 * rank:2 * rank + 2] for _ in range(4)]
        assert result["stream"]["seen"][3] == result["stream"]["seen"][0]             # 12 prompts: 3 batches, then again
    assert ranks[0]["stream"]["rewards"] == ranks[0]["dataset"]["rewards"] == ranks[1]["stream"]["rewards"]
