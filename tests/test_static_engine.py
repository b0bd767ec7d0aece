"""The static-cache engine (06s_static) samples what `generate` samples, on the CPU: the same tokens for the same random
state where the arithmetic is the same (float32, bf16 and fp16 models, greedy and seeded sampling with every sampling
setting, the shared prefill, LoRA, a 4-bit base), the same distribution from a half-precision merged copy, and a
training run that learns as the default engine's does."""
import copy
import logging
import math

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.models import load_policy, random_tiny_model, tiny_model_path, tiny_tokenizer
from grpo_lab.rollout import GenerateEngine, SamplingSettings
from grpo_lab.static_engine import DecodeStep, StaticCacheEngine

TINY = str(tiny_model_path())
PROMPTS = ["12+34=", "7-3=", "99+1=", "5+58="]


def rows_and_groups(prompts, G):
    rows = [{"prompt": p} for p in prompts for _ in range(G)]
    return rows, torch.arange(len(prompts)).repeat_interleave(G)


def settings(**kw):
    "Every sampling setting on (a repetition penalty, temperature, top-k, top-p and min-p), EOS = pad = 0."
    base = dict(temperature=0.9, top_p=0.95, top_k=20, min_p=0.02, repetition_penalty=1.1, max_new_tokens=12,
                eos_token_ids=[0], pad_token_id=0, bos_token_id=0)
    return SamplingSettings(**{**base, **kw})


def both(policy, engine, sampling, seed, share_prefill=True, G=4, prompts=PROMPTS, step=0):
    "The same request through generate and through `engine`, each from the same random state."
    rows, group = rows_and_groups(prompts, G)
    torch.manual_seed(seed)
    reference = GenerateEngine(tiny_tokenizer(), share_prefill=share_prefill).generate(rows, group, policy, sampling, step)
    torch.manual_seed(seed)
    return reference, engine.generate(rows, group, policy, sampling, step)


@pytest.fixture(scope="module")
def tiny():
    return AutoModelForCausalLM.from_pretrained(TINY).eval()


def with_lora(model, seed=0):
    "A LoRA policy whose adapter changes the model (B away from PEFT's zero)."
    torch.manual_seed(seed)
    policy = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=8, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return policy


@pytest.mark.parametrize("share_prefill", [True, False])
def test_same_tokens_as_generate_for_the_same_random_state(tiny, share_prefill):
    """Seeded sampling with every setting on, and greedy decoding, on a random model (long, varied completions) and
    the trained tiny model: token for token what generate samples, with and without generate's shared prefill."""
    engine, truncated = StaticCacheEngine(tiny_tokenizer()), []
    for name, model in {"trained": tiny, "random": random_tiny_model(seed=1).eval()}.items():
        for seed, sampling in [(0, settings()), (1, settings(max_new_tokens=24)),
                               (2, settings(generation_kwargs={"do_sample": False}))]:
            reference, static = both(model, engine, sampling, seed, share_prefill)
            assert torch.equal(reference.completion_ids, static.completion_ids), (name, seed)
            assert torch.equal(reference.completion_mask, static.completion_mask)
            assert torch.equal(reference.truncated, static.truncated)
            assert static.sampling_logps is None          # sampled by the policy itself: nothing to correct
            truncated.append(static.truncated)
    assert torch.cat(truncated).any() and not torch.cat(truncated).all()    # rows that end and rows that run out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_same_tokens_as_generate_in_half_precision(dtype):
    """A bf16 and an fp16 random model, 16 rows of 16 tokens: a static cache's attention reads its empty columns too,
    so half-precision rounding differs from generate's and a near tie can fall the other way, after which a row
    follows another sample path. At least 12 of the 16 rows are token for token generate's (measured: 14 to 16),
    and the first token of every row is (one step of rounding cannot flip it here)."""
    model = random_tiny_model(seed=1).to(dtype).eval()
    for seed in (0, 1):
        reference, static = both(model, StaticCacheEngine(tiny_tokenizer()), settings(max_new_tokens=16), seed)
        same_rows = (reference.completion_ids == static.completion_ids).all(1)
        assert same_rows.sum() >= 12, (seed, same_rows)
        assert torch.equal(reference.completion_ids[:, 0], static.completion_ids[:, 0])


def test_lora_policy_directly_and_through_a_float32_merged_copy(tiny):
    """A LoRA policy sampled as it is, and through a float32 merged copy: the same tokens as generate; the copy's
    log-probs are the policy's; after an optimizer step the copy is refreshed and follows."""
    policy = with_lora(tiny)
    reference, static = both(policy, StaticCacheEngine(tiny_tokenizer()), settings(), 0)
    assert torch.equal(reference.completion_ids, static.completion_ids)
    merged = StaticCacheEngine(tiny_tokenizer(), merged_copy=True)
    reference, static = both(policy, merged, settings(max_new_tokens=16), 1)
    assert torch.equal(reference.completion_ids, static.completion_ids)
    assert static.sampling_logps.shape == static.completion_ids.shape
    with torch.no_grad():                                  # an optimizer step moves the adapter
        for name, param in policy.named_parameters():
            if "lora_A" in name:
                param.add_(torch.randn_like(param) * 0.05)
    reference, static = both(policy, merged, settings(max_new_tokens=16), 2, step=1)
    assert torch.equal(reference.completion_ids, static.completion_ids)
    assert merged.copy.version == 1


def test_4bit_base_with_lora_directly_and_through_merged_copies():
    """An NF4 base + LoRA (bitsandbytes on the CPU): the policy itself and a float32 merged copy give generate's
    tokens; a bf16 copy samples the same distribution, measured exactly: the KL divergence between the copy's and
    the policy's next-token distributions along the copy's own samples is below 1e-3 nats a token."""
    torch.manual_seed(0)
    policy, tokenizer = load_policy(TINY, load_in_4bit=True, lora_r=8)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    for engine in (StaticCacheEngine(tokenizer), StaticCacheEngine(tokenizer, merged_copy=True)):
        reference, static = both(policy, engine, settings(), 0)
        assert torch.equal(reference.completion_ids, static.completion_ids)
    half = StaticCacheEngine(tokenizer, merged_copy=True, copy_dtype=torch.bfloat16)
    _, static = both(policy, half, settings(temperature=1.0, top_p=1.0, top_k=0, min_p=None), 3, G=16)
    ids = torch.cat([static.prompt_ids, static.completion_ids], 1)
    mask = torch.cat([static.prompt_mask, static.completion_mask], 1)
    T = static.completion_ids.size(1)
    with torch.no_grad():
        logp_policy = policy(input_ids=ids, attention_mask=mask).logits[:, -T - 1:-1].float().log_softmax(-1)
        logp_copy = half.copy.model(input_ids=ids, attention_mask=mask).logits[:, -T - 1:-1].float().log_softmax(-1)
    kl = (logp_copy.exp() * (logp_copy - logp_policy)).sum(-1)
    real = static.completion_mask.bool()
    assert kl[real].mean() < 1e-3, kl[real].mean()
    own = logp_copy.gather(-1, static.completion_ids.unsqueeze(-1)).squeeze(-1)     # the logged sampler log-probs
    assert torch.allclose(static.sampling_logps[real], own[real], atol=2e-2, rtol=2e-2)    # bf16: 2-3 digits


def test_half_precision_copy_samples_the_policys_distribution():
    """A float32 LoRA policy (random model: long, varied completions) against its bf16 merged copy, 512 completions
    each from different random states: completion lengths (mean within 4 standard errors of the difference), mean
    next-token entropy (within 4 standard errors) and token frequencies (chi-square test of homogeneity, p > 0.001)
    agree. The same checks between two seeds of generate itself pass at the same thresholds."""
    policy = with_lora(random_tiny_model(seed=2).eval(), seed=2)
    sampling = settings(max_new_tokens=16, top_k=0, min_p=None, repetition_penalty=1.0)
    reference, _ = both(policy, StaticCacheEngine(tiny_tokenizer()), sampling, 10, G=128)
    half = StaticCacheEngine(tiny_tokenizer(), merged_copy=True, copy_dtype=torch.bfloat16)
    _, static = both(policy, half, sampling, 11, G=128)
    lengths = [o.completion_mask.sum(1).float() for o in (reference, static)]
    se = math.sqrt(sum(x.var().item() / len(x) for x in lengths))
    assert abs(lengths[0].mean() - lengths[1].mean()) < 4 * se, (lengths[0].mean(), lengths[1].mean(), se)
    entropies = [entropy_per_row(policy, o) for o in (reference, static)]
    se = math.sqrt(sum(x.var().item() / len(x) for x in entropies))
    assert abs(entropies[0].mean() - entropies[1].mean()) < 4 * se
    counts = torch.stack([torch.bincount(o.completion_ids[o.completion_mask.bool()], minlength=200)
                          for o in (reference, static)])
    counts = counts[:, counts.sum(0) >= 10]                # chi-square needs populated cells
    assert homogeneity_pvalue(counts) > 1e-3


def homogeneity_pvalue(counts: torch.Tensor) -> float:
    "Pearson's chi-square test that the rows of a (2, K) table of counts come from one distribution: its p-value."
    counts = counts.double()
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = (counts.size(0) - 1) * (counts.size(1) - 1)
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), statistic / 2).item()


@torch.no_grad()
def entropy_per_row(policy, out):
    "Each row's mean next-token entropy over its completion, under the policy."
    ids = torch.cat([out.prompt_ids, out.completion_ids], 1)
    T = out.completion_ids.size(1)
    logp = policy(input_ids=ids, attention_mask=torch.cat([out.prompt_mask, out.completion_mask], 1)).logits[:, -T - 1:-1]
    logp = logp.float().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1) * out.completion_mask
    return entropy.sum(1) / out.completion_mask.sum(1).clamp(min=1)


def test_the_decode_step_compiles_as_one_graph(tiny):
    """The compiled decode step traces as one graph (fullgraph=True: no break that would split a CUDA graph capture)
    and samples the eager step's tokens; on CUDA the same step runs under mode="reduce-overhead"."""
    compiled = StaticCacheEngine(tiny_tokenizer(), compiled=True, compile_kwargs={"backend": "eager", "fullgraph": True})
    reference, static = both(tiny, compiled, settings(max_new_tokens=16), 0)
    assert torch.equal(reference.completion_ids, static.completion_ids)
    assert isinstance(compiled._step[1], DecodeStep) and compiled._step[1].compiled


def small_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=16, num_generations=8, max_completion_length=8,
                learning_rate=1.5e-3, temperature=1.5, max_steps=30, disable_tqdm=True, gradient_checkpointing=False,
                save_strategy="no", report_to=[], use_cpu=True, logging_steps=1)
    return GRPOConfig(**{**base, **kw})


def shorter(prompts, completions, **kw):
    return [-float(len(c)) for c in completions]


def test_engine_choice_is_logged_and_can_be_forced(tmp_path, caplog):
    "auto on a CPU: generate; 'static' forces the engine; settings it cannot honour and unknown names are refused."
    with caplog.at_level(logging.INFO, logger="grpo_lab.static_engine"):
        auto = GRPOTrainer(TINY, shorter, args=small_args(tmp_path / "a"), train_dataset=arithmetic_task(16))
    assert type(auto.engine) is GenerateEngine and "Sampling with generate" in caplog.text
    with caplog.at_level(logging.INFO, logger="grpo_lab.static_engine"):
        forced = GRPOTrainer(TINY, shorter, args=small_args(tmp_path / "b", generation_engine="static"),
                             train_dataset=arithmetic_task(16))
    assert type(forced.engine) is StaticCacheEngine and "static-cache engine (eager decode step" in caplog.text
    with pytest.raises(ValueError, match="generation_kwargs \\['stop_strings'\\]"):
        GRPOTrainer(TINY, shorter, args=small_args(tmp_path / "c", generation_engine="static",
                                                  generation_kwargs={"stop_strings": ["\n"]}),
                    train_dataset=arithmetic_task(16))
    with pytest.raises(ValueError, match="generation_engine='fast'"):
        small_args(tmp_path / "d", generation_engine="fast")


def test_training_with_the_static_engine_learns_as_the_default_engine_does(tmp_path):
    """The demo's length reward, 30 steps, the static engine forced vs the default engine (generate on a CPU), same
    seed: both learn (the mean length of the last 5 steps at least 1 token below the first 5) and, since the engine
    samples generate's tokens, their per-step rewards agree to 1e-4 (a margin of zero in place of the seed spread)."""
    curves = {}
    for engine in ("generate", "static"):
        trainer = GRPOTrainer(TINY, shorter, args=small_args(tmp_path / engine, generation_engine=engine),
                              train_dataset=arithmetic_task(512))
        trainer.train()
        curves[engine] = [h["completions/mean_length"] for h in trainer.history if "completions/mean_length" in h]
        assert sum(curves[engine][-5:]) / 5 <= sum(curves[engine][:5]) / 5 - 1.0, curves[engine]
    assert curves["generate"] == pytest.approx(curves["static"], abs=1e-4), curves


def test_generate_logits_processors_from_generation_kwargs(tiny):
    "generation_kwargs that are logits processors (min_new_tokens, no_repeat_ngram_size, typical_p) apply as in generate."
    sampling = settings(generation_kwargs={"min_new_tokens": 6, "no_repeat_ngram_size": 2, "typical_p": 0.9})
    reference, static = both(tiny, StaticCacheEngine(tiny_tokenizer()), sampling, 4)
    assert torch.equal(reference.completion_ids, static.completion_ids)
    assert (static.completion_mask.sum(1) >= 7).all()          # six tokens at least, then the EOS
