"""Learning parity with TRL, step by step: the same model, adapter, data order and completions give the same weights.

TRL 1.16's GRPOTrainer trains SmolLM2-135M-Instruct with a LoRA adapter for a few optimizer steps; every completion
it samples is recorded. grpo-lab's GRPOTrainer then trains a copy of the same adapter on the same prompts, with an
engine that replays TRL's completions instead of sampling. Sampling is the only random part of a GRPO step (no
dropout), so from there on both trainers compute the same function: rewards, advantages, the dapo loss under
gradient accumulation, clipping, AdamW and the linear schedule. The adapter weights are compared after every step.

Then the sampling (issue 43): with torch's generator reseeded before every `generate` call in both trainers (the same
seed for the same call), grpo-lab's own engine samples TRL's completions token for token at every step, and the
adapters end equal. The two trainers differ only in which random numbers they draw between generations (TRL shuffles
each generation batch with the global generator, grpo-lab with its own seeded one), so a gap between their held-out
accuracies on one seed is sampling noise (BENCHMARKS.md, "What the gap was").
"""
import contextlib
import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from transformers import TrainerCallback  # noqa: E402

from conftest import smollm2_with_lora  # noqa: E402
from grpo_lab import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_lab.rollout import (Completions, RolloutEngine, completion_mask, render_prompts,  # noqa: E402
                              tokenize_prompts)

STEPS, G, PER_DEVICE, GA, NEW_TOKENS = 4, 4, 4, 2, 12
PROBLEMS = ["12+34=", "7+5=", "40-13=", "9+88=", "63-7=", "25+25=", "3+4=", "81-19="]   # 2 prompts a step, 4 steps
# Tolerances, on all adapter tensors taken together (Frobenius norms), both runs in float32.
# - The gradient of each step (after clipping): |g_grpo_lab - g_trl| / |g_trl| <= GRAD_TOLERANCE. Both compute the
#   same sums in a different order (each trainer shuffles the rows across micro-batches with its own permutation, and
#   the dapo loss makes the accumulated gradient independent of the split; grpo-lab numbers positions from each row's
#   first real token, TRL from the padded start, which RoPE's relative angles make equal up to rounding). At step 1
#   the weights are identical and the gap is pure float32 reordering (measured 4.5e-6: 1e-5 allowed); later steps
#   start from weights that already differ by the rounding below, and their gradients inherit it (measured
#   0.8-1.3e-5: 5e-5 allowed). A difference in what is computed (advantages, mask, loss scale, a token) is not
#   rounding and shows at step 1.
# - The weights after each step: |w_grpo_lab - w_trl| / |w_trl - w_0| <= WEIGHT_TOLERANCE, the gap relative to how
#   far training moved the adapter. AdamW's update is g / (sqrt(v) + eps), so an entry whose gradient is rounding
#   noise near eps = 1e-8 can move by a different fraction of lr in each run: one such entry among the 0.92M adapter
#   entries (q_proj, v_proj; 30 layers) is ~5e-4 of the whole update (measured: 4.0e-4, 2.8e-4, 2.5e-4, 2.3e-4
#   over the 4 steps: no drift).
#   A wrong learning rate, schedule or optimizer setting moves it by >= 1e-2.
FIRST_GRAD_TOLERANCE, GRAD_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 5e-5, 5e-3


def reward_digits_and_length(prompts, completions, answer, **kwargs):
    "Deterministic and varied within a group: 1 if the answer appears, minus the distance from 20 characters."
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a in t) - abs(len(t) - 20) / 20 for t, a in zip(texts, answer)]


def dataset():
    from datasets import Dataset
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROBLEMS],
                              "answer": [str(eval(p[:-1])) for p in PROBLEMS]})


def shared_settings(output_dir) -> dict:
    "The same settings for both trainers (field names as in TRL's GRPOConfig)."
    return dict(output_dir=str(output_dir), per_device_train_batch_size=PER_DEVICE, gradient_accumulation_steps=GA,
                num_generations=G, max_completion_length=NEW_TOKENS, temperature=0.7, loss_type="dapo",
                learning_rate=2e-4, lr_scheduler_type="linear", max_steps=STEPS, shuffle_dataset=False, seed=0,
                use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", logging_steps=1,
                save_strategy="no", disable_tqdm=True)


def adapter_weights(model) -> dict:
    return {n: p.detach().clone().float() for n, p in model.named_parameters() if "lora_" in n}


def flat(tensors: dict) -> torch.Tensor:
    return torch.cat([tensors[n].flatten() for n in sorted(tensors)])


class RecordSteps(TrainerCallback):
    "The adapter's clipped gradient and weights at every optimizer step, and the logged learning rates and norms."
    def __init__(self, model):
        self.model, self.weights, self.grads, self.learning_rates, self.grad_norms = model, [], [], [], []

    def on_optimizer_step(self, args, state, control, **kwargs):     # after the step, before the gradient is zeroed
        self.grads.append({n: p.grad.detach().clone().float() for n, p in self.model.named_parameters()
                           if "lora_" in n})

    def on_step_end(self, args, state, control, **kwargs):
        self.weights.append(adapter_weights(self.model))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "learning_rate" in logs and "train_runtime" not in logs:
            self.learning_rates.append(logs["learning_rate"])
            self.grad_norms.append(logs["grad_norm"])


class ReplayEngine(RolloutEngine):
    "Returns the completions TRL sampled for the same prompts, in TRL's order; fails on any other request."
    def __init__(self, tokenizer, batches: list[dict]):
        self.tokenizer, self.batches, self.calls = tokenizer, batches, 0

    def generate(self, rows, group, policy, settings, step) -> Completions:
        if self.calls >= len(self.batches):
            raise AssertionError(f"grpo-lab asked for generation batch {self.calls + 1}; TRL sampled only "
                                 f"{len(self.batches)}")
        batch = self.batches[self.calls]
        prompts = [r["prompt"] for r in rows]
        if prompts != batch["prompts"]:
            raise AssertionError(f"generation batch {self.calls}: grpo-lab asks for {prompts}, TRL sampled "
                                 f"{batch['prompts']}")
        if step != self.calls:
            raise AssertionError(f"generation batch {self.calls} is asked for at step {step}; TRL sampled it at "
                                 f"step {self.calls}")
        self.calls += 1
        texts = render_prompts(prompts, self.tokenizer, settings.chat_template_kwargs, group)
        ours, _, _ = tokenize_prompts(self.tokenizer, texts)
        pad = settings.pad_token_id
        width = max(len(x) for x in batch["prompt_ids"])
        prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch["prompt_ids"]])
        prompt_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch["prompt_ids"]])
        if not torch.equal(ours, prompt_ids):
            raise AssertionError(f"grpo-lab tokenizes the prompts {texts} differently from TRL:\n{ours}\n{prompt_ids}")
        length = max(len(x) for x in batch["completion_ids"])
        completion_ids = torch.tensor([x + [pad] * (length - len(x)) for x in batch["completion_ids"]])
        mask, truncated = completion_mask(completion_ids, settings.eos_token_ids)
        return Completions(texts, prompt_ids, prompt_mask, completion_ids, mask, truncated, group)


@contextlib.contextmanager
def aligned_generation(seed: int = 1000):
    "Inside: torch's generator is reseeded before every `generate` call (the n-th call gets `seed + n`), in any trainer."
    from transformers.generation.utils import GenerationMixin
    original, calls = GenerationMixin.generate, [0]

    def generate(self, *args, **kwargs):
        calls[0] += 1
        torch.manual_seed(seed + calls[0])
        return original(self, *args, **kwargs)

    GenerationMixin.generate = generate
    try:
        yield calls
    finally:
        GenerationMixin.generate = original


@pytest.fixture(scope="module")
def lora_model(smollm2_folder):
    "SmolLM2 in float32 with one LoRA adapter (r=16, no dropout), B initialised away from zero so every tensor moves."
    return smollm2_with_lora(smollm2_folder, ["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def runs(lora_model, tmp_path_factory):
    "TRL's run (completions, weights, learning rates per step), then grpo-lab's on the replayed completions."
    model, tokenizer = lora_model
    initial = adapter_weights(model)

    trl_model = copy.deepcopy(model)
    trl_record = RecordSteps(trl_model)
    trainer = trl.GRPOTrainer(model=trl_model, reward_funcs=reward_digits_and_length,
                              args=trl.GRPOConfig(**shared_settings(tmp_path_factory.mktemp("trl"))),
                              train_dataset=dataset(), processing_class=copy.deepcopy(tokenizer),
                              callbacks=[trl_record])
    batches, sample = [], trainer._generate

    def recording(prompts):          # TRL's generation of one batch: record the prompts and the ids it returns
        out = sample(prompts)
        batches.append({"prompts": copy.deepcopy(prompts), "prompt_ids": [list(x) for x in out[0]],
                        "completion_ids": [list(x) for x in out[1]]})
        return out

    trainer._generate = recording
    with aligned_generation():       # the same random numbers at each generation as grpo-lab's run below
        trainer.train()

    lab_model = copy.deepcopy(model)
    lab_record = RecordSteps(lab_model)
    engine = ReplayEngine(tokenizer, batches)
    lab = GRPOTrainer(model=lab_model, reward_funcs=reward_digits_and_length,
                      args=GRPOConfig(**shared_settings(tmp_path_factory.mktemp("grpo_lab"))), train_dataset=dataset(),
                      processing_class=copy.deepcopy(tokenizer), callbacks=[lab_record], engine=engine)
    lab.train()
    return dict(initial=initial, batches=batches, trl=trl_record, lab=lab_record, engine=engine, trl_trainer=trainer,
                lab_trainer=lab)


def test_trl_ran_the_steps_and_sampled_varied_completions(runs):
    "The comparison means something: TRL took every step, sampled EOS-ended and cut-off rows, with rewards that differ."
    assert len(runs["trl"].weights) == STEPS and len(runs["batches"]) == STEPS
    lengths = [len(c) for b in runs["batches"] for c in b["completion_ids"]]
    assert len(set(lengths)) > 2, lengths
    assert max(lengths) == NEW_TOKENS and min(lengths) < NEW_TOKENS, lengths


def test_same_data_order_and_every_completion_replayed(runs):
    "grpo-lab asked for TRL's prompts in TRL's order (the engine fails otherwise), one batch per step, all of them."
    assert runs["engine"].calls == STEPS
    assert [b["prompts"][0][0]["content"] for b in runs["batches"]] == PROBLEMS[::2][:STEPS]
    assert len(runs["lab"].weights) == STEPS


def test_same_learning_rate_every_step(runs):
    "The linear schedule is at the same point at every optimizer step (lr logged is the one the step used)."
    assert len(runs["lab"].learning_rates) == STEPS
    assert runs["lab"].learning_rates == pytest.approx(runs["trl"].learning_rates, rel=1e-12)


def relative_gaps(ours: list[dict], theirs: list[dict], origin: dict | None = None) -> list[float]:
    "Per step: |ours - theirs| / |theirs - origin| over all adapter tensors together."
    assert len(ours) == len(theirs) == STEPS
    zero = flat({n: torch.zeros_like(v) for n, v in theirs[0].items()})
    start = flat(origin) if origin is not None else zero
    return [((flat(a) - flat(b)).norm() / (flat(b) - start).norm()).item() for a, b in zip(ours, theirs)]


def test_same_gradient_every_step(runs):
    "The clipped gradient of every optimizer step matches TRL's to GRAD_TOLERANCE; so does the logged grad norm."
    assert runs["lab"].grad_norms == pytest.approx(runs["trl"].grad_norms, rel=GRAD_TOLERANCE)
    gaps = relative_gaps(runs["lab"].grads, runs["trl"].grads)
    print("gradient gaps per step:", [f"{g:.1e}" for g in gaps])
    assert gaps[0] <= FIRST_GRAD_TOLERANCE and max(gaps) <= GRAD_TOLERANCE, [f"{g:.1e}" for g in gaps]


def test_adapter_weights_equal_after_every_step(runs):
    "After each optimizer step the adapter matches TRL's to WEIGHT_TOLERANCE of how far training moved it."
    initial, trl_weights = runs["initial"], runs["trl"].weights
    still = [n for n in initial if (trl_weights[0][n] - initial[n]).norm() == 0]
    assert not still, f"adapter tensors the first step did not move: {still[:4]}"
    gaps = relative_gaps(runs["lab"].weights, trl_weights, initial)
    print("weight gaps per step:", [f"{g:.1e}" for g in gaps])
    assert max(gaps) <= WEIGHT_TOLERANCE, [f"{g:.1e}" for g in gaps]


@pytest.fixture(scope="module")
def sampled_run(lora_model, runs, tmp_path_factory):
    "grpo-lab sampling with its own (default, shared-prefill) engine, torch's generator reseeded as in TRL's run."
    model, tokenizer = lora_model
    lab_model = copy.deepcopy(model)
    record = RecordSteps(lab_model)
    lab = GRPOTrainer(model=lab_model, reward_funcs=reward_digits_and_length,
                      args=GRPOConfig(**shared_settings(tmp_path_factory.mktemp("sampled"))), train_dataset=dataset(),
                      processing_class=copy.deepcopy(tokenizer), callbacks=[record])
    sampled, generate = [], lab.engine.generate

    def recording(rows, group, policy, settings, step):
        out = generate(rows, group, policy, settings, step)
        sampled.append([ids[mask.bool()].tolist() for ids, mask in zip(out.completion_ids, out.completion_mask)])
        return out

    lab.engine.generate = recording
    with aligned_generation():
        lab.train()
    return dict(sampled=sampled, record=record)


def without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def test_with_the_same_random_numbers_grpo_lab_samples_trls_completions_every_step(runs, sampled_run, lora_model):
    """Issue 43's ablation in small: reseeded alike, grpo-lab's own engine draws TRL's completions at every step (the
    policy moves after step 1, so steps 2-4 sample from updated weights), and the adapters end equal."""
    eos = lora_model[1].eos_token_id
    theirs = [[without_eos(c, eos) for c in b["completion_ids"]] for b in runs["batches"]]
    ours = [[without_eos(c, eos) for c in batch] for batch in sampled_run["sampled"]]
    assert len(ours) == len(theirs) == STEPS
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"step {step + 1}: grpo-lab sampled {a}, TRL {b}"
    gaps = relative_gaps(sampled_run["record"].weights, runs["trl"].weights, runs["initial"])
    assert max(gaps) <= WEIGHT_TOLERANCE, [f"{g:.1e}" for g in gaps]
