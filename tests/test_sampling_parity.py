"""Sampling parity with TRL: each sampler draws from the policy the trainer learns from, and grpo-lab's draws are TRL's.

GRPO's loss treats every completion as a sample of the policy at temperature T: the log-probs it computes in a forward
pass (logits / T, log-softmax) must be those of the distribution the tokens were drawn from. Here the sampler's own
distribution is read from `generate`'s processed scores (what is left after every logits processor and warper, the
scores the token is drawn from) for grpo-lab's two engines (padded `generate` and the shared prefill) and for TRL
1.16's generation path, and compared with each trainer's own training-side log-probs of the same tokens. A hidden
processor (a model default top_k=50 or top_p, a repetition penalty, a temperature applied twice or not at all) or a
wrong position or mask in the shared prefill shows as a gap far above rounding. With the same seed, grpo-lab's padded
engine and TRL call `generate` with the same inputs and settings, so they draw the same tokens.
"""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")


import grpo_lab.trainer as lab_trainer  # noqa: E402
from conftest import smollm2_with_lora  # noqa: E402
from grpo_lab import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_lab.loss import completion_logps  # noqa: E402
from grpo_lab.rollout import GenerateEngine  # noqa: E402
from grpo_lab.steps import generation_rows  # noqa: E402

G, NEW_TOKENS, TEMPERATURE, SEED = 4, 16, 0.7, 0
# Prompts of different lengths, so that rows are left-padded (positions and masks matter) and groups share a prefix.
PROMPTS = ["What is 12 + 34? Answer with just the number.", "Name a colour.",
           "Write one short sentence about the sea, and then say why you like it."]
# Tolerance on |log p_policy - log p_sampler| per sampled token (float32). The sampler's logits come from a forward
# pass that reads a KV cache one token at a time, the policy's from one pass over the whole sequence (and TRL's
# through its fused LM head): the same sums in another order, whose rounding reaches ~1e-5 in logits of magnitude ~30
# and is divided by T = 0.7. Measured max over the 12 x 16 tokens: 2.0e-5 (padded generate), 4.1e-5 (shared prefill:
# its prompt cache comes from a separate forward pass over 3 rows), 2.3e-5 (TRL); 1e-3 leaves 25x room. What the check
# must catch is a different distribution: a temperature left out misses by 1.05 here (tested below), a repetition
# penalty of 1.1 moves a repeated token's logit by ~10% of its value, a top-k or top-p cut renormalises every
# token's log-prob by the mass it leaves out.
TOLERANCE = 1e-3


def reward_length(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def settings(output_dir) -> dict:
    return dict(output_dir=str(output_dir), per_device_train_batch_size=len(PROMPTS) * G, num_generations=G,
                max_completion_length=NEW_TOKENS, temperature=TEMPERATURE, seed=SEED, use_cpu=True, bf16=False,
                report_to="none", save_strategy="no", disable_tqdm=True, max_steps=1)


def dataset():
    from datasets import Dataset
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})


class RecordScores:
    "Wraps a model's `generate` on the instance: keeps the processed scores of each call and what it was given."
    def __init__(self, model):
        self.model, self.generate, self.calls = model, model.generate, []
        model.generate = self

    def __call__(self, *args, **kwargs):
        out = self.generate(*args, **kwargs, output_scores=True, return_dict_in_generate=True)
        self.calls.append({"scores": torch.stack(out.scores, 1), "prefilled": kwargs.get("cache") is not None,
                           "prompt_ids": kwargs["input_ids"]})
        return out.sequences

    def sampler_logps(self, completion_ids: torch.Tensor) -> torch.Tensor:
        "`(B, T)` log-probs of the sampled tokens under the distribution they were drawn from (the last call's)."
        scores = self.calls[-1]["scores"][:, :completion_ids.size(1)]
        return torch.log_softmax(scores.float(), -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def lora_model(smollm2_folder):
    "SmolLM2 in float32 with a LoRA adapter (r=16, no dropout) whose B is away from zero, so the adapter counts."
    return smollm2_with_lora(smollm2_folder, "all-linear")


@pytest.fixture(scope="module")
def lab(lora_model, tmp_path_factory):
    "grpo-lab's trainer, and for each engine: the completions it sampled, its sampler's and the policy's log-probs."
    model, tokenizer = lora_model
    trainer = GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward_length, processing_class=tokenizer,
                          args=GRPOConfig(**settings(tmp_path_factory.mktemp("lab"))), train_dataset=dataset())
    policy = trainer.accelerator.unwrap_model(trainer.model)
    recorder = RecordScores(policy)
    rows, group = generation_rows(list(dataset()), G)
    results = {}
    for name, engine in (("generate", GenerateEngine(tokenizer)), ("shared prefill", GenerateEngine(tokenizer, share_prefill=None))):
        trainer.engine = engine
        torch.manual_seed(SEED)
        out = lab_trainer._completions(trainer, rows, group)      # the trainer's one call to its engine
        ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
        mask = torch.cat([out.prompt_mask, out.completion_mask], 1)
        with torch.no_grad():        # the log-probs the loss uses: the trainer's own function, at the trainer's T
            policy_logps, _ = completion_logps(trainer.model, ids, mask, out.completion_ids.size(1),
                                               temperature=trainer.args.temperature)
            untempered, _ = completion_logps(trainer.model, ids, mask, out.completion_ids.size(1))
        results[name] = dict(out=out, sampler=recorder.sampler_logps(out.completion_ids), policy=policy_logps,
                             untempered=untempered, prefilled=recorder.calls[-1]["prefilled"])
    return results


@pytest.fixture(scope="module")
def trl_run(lora_model, tmp_path_factory):
    "TRL's generation of the same rows with the same seed, its sampler's log-probs and its training-side log-probs."
    model, tokenizer = lora_model
    trainer = trl.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=reward_length, processing_class=tokenizer,
                              args=trl.GRPOConfig(**settings(tmp_path_factory.mktemp("trl"))), train_dataset=dataset())
    recorder = RecordScores(trainer.accelerator.unwrap_model(trainer.model))
    trainer.model.train()                   # as during training
    torch.manual_seed(SEED)
    prompt_ids, completion_ids = trainer._generate([r["prompt"] for r in generation_rows(list(dataset()), G)[0]])[:2]
    pad, width, length = tokenizer.pad_token_id, max(map(len, prompt_ids)), max(map(len, completion_ids))
    p_ids = torch.tensor([[pad] * (width - len(x)) + list(x) for x in prompt_ids])
    p_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompt_ids])
    c_ids = torch.tensor([list(x) + [pad] * (length - len(x)) for x in completion_ids])
    c_mask = torch.tensor([[1] * len(x) + [0] * (length - len(x)) for x in completion_ids])
    with torch.no_grad():                   # TRL's own training-side log-probs (its fused LM head, logits / T)
        policy_logps = trainer._get_per_token_logps_and_entropies(trainer.model, torch.cat([p_ids, c_ids], 1),
                                                                  torch.cat([p_mask, c_mask], 1), length)[0]
    return dict(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=c_ids, completion_mask=c_mask, policy=policy_logps,
                sampler=recorder.sampler_logps(c_ids))


def gap(policy: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> float:
    "Largest |policy - sampler| log-prob over the sampled tokens (up to and including EOS)."
    return (policy - sampler).abs()[mask.bool()].max().item()


def test_the_draws_are_varied_and_exercise_padding_and_the_shared_prefill(lab):
    "The comparison means something: left-padded rows, EOS-ended and cut-off completions, and a real shared prefill."
    out = lab["generate"]["out"]
    assert (out.prompt_mask == 0).any(), "no row is left-padded"
    lengths = out.completion_mask.sum(1)
    assert lengths.min() < NEW_TOKENS and lengths.max() == NEW_TOKENS, lengths
    assert lab["shared prefill"]["prefilled"] and not lab["generate"]["prefilled"]


@pytest.mark.parametrize("engine", ["generate", "shared prefill"])
def test_grpo_lab_samples_from_the_policy_it_learns_from(lab, engine):
    "Every sampled token's log-prob under the sampler equals the trainer's policy log-prob at T, to rounding."
    r = lab[engine]
    assert gap(r["policy"], r["sampler"], r["out"].completion_mask) < TOLERANCE


def test_the_check_sees_a_wrong_temperature(lab):
    "The policy's log-probs at T = 1 miss the sampler's by far more than the tolerance: the check can fail."
    r = lab["generate"]
    assert gap(r["untempered"], r["sampler"], r["out"].completion_mask) > 30 * TOLERANCE


def test_trl_samples_from_the_policy_it_learns_from(trl_run):
    "The same holds for TRL 1.16's generation path and its fused-LM-head log-probs."
    assert gap(trl_run["policy"], trl_run["sampler"], trl_run["completion_mask"]) < TOLERANCE


def test_same_seed_same_draws_as_trl(lab, trl_run):
    "grpo-lab's padded engine gives generate the prompt tokens and settings TRL gives it, so one seed draws one sample."
    out = lab["generate"]["out"]
    assert torch.equal(out.prompt_ids, trl_run["prompt_ids"]) and torch.equal(out.prompt_mask, trl_run["prompt_mask"])
    ours = [c[m.bool()].tolist() for c, m in zip(out.completion_ids, out.completion_mask)]
    theirs = [c[m.bool()].tolist() for c, m in zip(trl_run["completion_ids"], trl_run["completion_mask"])]
    assert ours == theirs
