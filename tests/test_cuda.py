"""grpo-lab on a CUDA GPU: 4-bit loading, every precision row against TRL, checkpoints, the engines, the memory estimate.

Every test here carries the `cuda` marker and is skipped, with the reason, where torch sees no CUDA device. On a GPU
machine: `python -m pytest tests/test_cuda.py -m cuda` (or `bash benchmarks/gpu_check.sh`, which runs them with the
benchmarks and writes one report). `GRPO_LAB_CUDA_TESTS_ON_CPU=1` runs the rows a CPU can run on the CPU instead
(fp32/bf16 weights, bf16 autocast, 4-bit through bitsandbytes' CPU backend): it checks the tests' own code where no
GPU is at hand (benchmarks/gpu_check.py --dry-run does), and proves nothing about CUDA.

A precision row is (weights' dtype: fp32, bf16, fp16) x (mixed precision: `bf16=True` or `fp16=True`) x (full
fine-tuning, LoRA, LoRA on a 4-bit NF4 base) x (beta 0, beta 0.04). Rows that force fp16 mimic a T4 (compute
capability 7.5, no bf16): an H100 says `torch.cuda.is_bf16_supported()` is True and grpo-lab would choose bf16 itself,
so the T4 path would go untested on the GPUs these tests run on.

Expected figures on a GPU are not measured yet (no GPU was available when this file was written): the TRL tolerances
below are first estimates from the precision's rounding, to be tightened from the first GPU report.
"""
import dataclasses
import math
import os

import pytest
import torch

from grpo_lab.models import tiny_model_path

ON_CPU = os.environ.get("GRPO_LAB_CUDA_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
NO_CUDA = ("no CUDA device (torch.cuda.is_available() is False): these tests run on a GPU machine, e.g. `bash "
           "benchmarks/gpu_check.sh`; GRPO_LAB_CUDA_TESTS_ON_CPU=1 runs the CPU-possible rows on the CPU")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA and not ON_CPU, reason=NO_CUDA)]

DEVICE = torch.device("cuda" if HAS_CUDA and not ON_CPU else "cpu")
TINY = str(tiny_model_path())
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("full", "lora", "qlora")
STEPS, PER_DEVICE, G, NEW_TOKENS = 3, 8, 4, 5
# TRL comparison, per logged step, on the same model, prompts and (replayed) completions. Mixed precision rounds
# logits and activations to 8 (bf16) or 11 (fp16) mantissa bits, in a different order in each trainer:
# |loss_lab - loss_trl| <= LOSS_ATOL + LOSS_RTOL |loss_trl|; grad_norm and entropy relative. Not yet measured.
LOSS_ATOL, LOSS_RTOL, GRAD_NORM_RTOL, ENTROPY_RTOL = 2e-2, 5e-2, 5e-2, 2e-2


def needs_device(model_dtype: str, mixed: str):
    "Skip a row the CPU cannot run when the tests run on the CPU (fp16 autocast and fp16 weights need CUDA)."
    if DEVICE.type == "cpu" and (mixed == "fp16" or model_dtype == "fp16"):
        pytest.skip("fp16 mixed precision and fp16 weights need CUDA (GRPO_LAB_CUDA_TESTS_ON_CPU runs the others)")


@pytest.fixture
def t4(monkeypatch):
    "Make this GPU answer as a T4 does (compute capability 7.5, no bf16), so that grpo-lab takes the T4's path."
    if DEVICE.type == "cuda":
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)


def row_config(tmp_path, mixed: str, mode: str, beta: float, **extra):
    "GRPOConfig of one precision row on the tiny model (grpo-lab's own loading: model_init_kwargs, lora_r, load_in_4bit)."
    from grpo_lab import GRPOConfig
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=PER_DEVICE, num_generations=G,
                    max_completion_length=NEW_TOKENS, learning_rate=1e-3 if mode != "full" else 1e-4,
                    max_steps=STEPS, logging_steps=1, beta=beta, bf16=mixed == "bf16", fp16=mixed == "fp16",
                    gradient_checkpointing=False, save_strategy="no", report_to="none", disable_tqdm=True,
                    use_cpu=DEVICE.type == "cpu", seed=0)
    return GRPOConfig(**{**settings, **extra})


def row_shortcuts(mode: str) -> dict:
    "The trainer's LoRA/4-bit keyword arguments of a row (grpo-lab's shortcuts; TRL's ModelConfig owns the field names)."
    return dict(lora_r=None if mode == "full" else 4, load_in_4bit=mode == "qlora")


def answer_and_length(prompts, completions, answer, **kwargs) -> list[float]:
    "Varied within a group (unlike exact_answer on the tiny model, often 0 for all G): the answer, minus a length cost."
    return [float(a in c) - abs(len(c) - 3) / 3 for c, a in zip(completions, answer)]


def trainable(model) -> dict:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


# Rows grpo-lab refuses at construction (with the fix), where the HF Trainer and so TRL stop during the first step:
# fp16's GradScaler cannot unscale half-precision gradients (full fine-tuning of fp16 or bf16 weights; on a CPU there
# is no scaler and they train), and bf16 autocast cannot mix with a 4-bit base's float16 weights. Value: in the message.
REFUSED_ROWS = {("fp16", "fp16", "full"): "GradScaler cannot unscale float16", ("bf16", "fp16", "full"):
                "GradScaler cannot unscale bfloat16", ("fp16", "bf16", "qlora"): "float16"}
ROWS = [(d, m, mode, beta) for d in DTYPES for m in ("bf16", "fp16") for mode in MODES for beta in (0.0, 0.04)]
ROW_IDS = [f"{d}-weights-{m}-mixed-{mode}-beta{beta:g}" for d, m, mode, beta in ROWS]


# --- 4-bit loading ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("as_t4", [False, True], ids=["native", "t4"])
def test_4bit_nf4_loading_on_cuda(as_t4, request):
    "load_in_4bit gives bitsandbytes NF4 layers (double quantization) on the GPU, computing in the GPU's half dtype."
    bnb = pytest.importorskip("bitsandbytes", reason="4-bit loading needs bitsandbytes (pip install bitsandbytes)")
    if as_t4:
        request.getfixturevalue("t4")
    from grpo_lab.models import compute_dtype_for, load_policy
    model, tokenizer = load_policy(TINY, load_in_4bit=True, lora_r=4)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 4 * 7, len(layers)            # 4 blocks x (q, k, v, o, gate, up, down)
    expected = torch.float16 if as_t4 and DEVICE.type == "cuda" else compute_dtype_for(DEVICE)
    for layer in layers:
        assert layer.weight.quant_type == "nf4" and layer.weight.quant_state.nested   # double quantization
        assert layer.weight.device.type == DEVICE.type and layer.compute_dtype == expected
    ids = tokenizer(["12+34="], return_tensors="pt").input_ids.to(DEVICE)
    logits = model(input_ids=ids).logits
    assert logits.device.type == DEVICE.type and torch.isfinite(logits).all()


# --- every precision row trains ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model_dtype,mixed,mode,beta", ROWS, ids=ROW_IDS)
def test_precision_row_trains(model_dtype, mixed, mode, beta, tmp_path, request):
    """A few GRPO steps on the tiny model in this row: finite losses, finite gradient norms (an fp16 step the loss
    scaler skips may log an infinite norm, as in the HF Trainer, but the run goes on), and the trained weights move.
    The one row a trainer may refuse instead is full fine-tuning of fp16 weights under fp16 mixed precision (the loss
    scaler cannot unscale fp16 gradients): then the error must say so at construction, naming fp16."""
    needs_device(model_dtype, mixed)
    if mode == "qlora":
        pytest.importorskip("bitsandbytes", reason="4-bit rows need bitsandbytes")
    if mixed == "fp16":
        request.getfixturevalue("t4")
    from grpo_lab import GRPOTrainer
    from grpo_lab.data import arithmetic_task
    args = row_config(tmp_path, mixed, mode, beta, model_init_kwargs={"dtype": str(DTYPES[model_dtype]).split(".")[1]})
    refusal = REFUSED_ROWS.get((model_dtype, mixed, mode))
    try:
        trainer = GRPOTrainer(TINY, answer_and_length, args=args, train_dataset=arithmetic_task(64), **row_shortcuts(mode))
    except ValueError as e:
        assert refusal and refusal in str(e), e
        return
    assert refusal is None or DEVICE.type == "cpu", f"{refusal}: expected a refusal at construction on {DEVICE}"
    before = trainable(trainer.model)
    assert before and all(p.device.type == DEVICE.type for p in trainer.model.parameters())
    trainer.train()
    steps = trainer.history
    assert len(steps) == STEPS, steps
    assert all(math.isfinite(s["loss"]) for s in steps), steps
    finite_norms = [s["grad_norm"] for s in steps if math.isfinite(s["grad_norm"])]
    assert finite_norms and (mixed == "fp16" or len(finite_norms) == STEPS), steps
    after = trainable(trainer.model)
    moved = sum(not torch.equal(before[n], after[n]) for n in before)
    assert moved >= len(before) // 2, f"{moved} of {len(before)} trainable tensors changed"
    if beta:
        assert all(math.isfinite(s["kl"]) for s in steps), steps


# --- every precision row against TRL, on the same completions ---------------------------------------------------

def build_policy(mode: str, model_dtype: torch.dtype, perturb_lora: bool, seed: int = 0):
    """The tiny model as this row trains it (full, LoRA r=4, or LoRA on NF4), on the device; the same for the same seed.
    `perturb_lora` starts B away from zero (else A's first gradient is zero). Only with beta = 0: given a PeftModel and
    beta > 0, TRL 1.16 takes a frozen copy of the initial adapter as the reference, grpo-lab the base model (adapter
    disabled); the two agree only for an adapter that starts at zero, as peft initialises it."""
    import peft
    from transformers import AutoModelForCausalLM
    from grpo_lab.models import _device, _load_kwargs
    if mode == "qlora":
        kwargs = _load_kwargs(_device() if DEVICE.type == "cuda" else torch.device("cpu"), True, True, model_dtype, None, False)
        model = AutoModelForCausalLM.from_pretrained(TINY, **kwargs)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(TINY, dtype=model_dtype).to(DEVICE)
    if mode == "full":
        return model
    torch.manual_seed(seed)                 # A's random start, the same in both copies
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear",
                                                       task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and perturb_lora:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def trl_settings(tmp_path, mixed: str, beta: float) -> dict:
    "Settings both trainers read with the same meaning (TRL's GRPOConfig names)."
    return dict(output_dir=str(tmp_path), per_device_train_batch_size=PER_DEVICE, num_generations=G,
                max_completion_length=NEW_TOKENS, learning_rate=1e-4, lr_scheduler_type="constant", max_steps=STEPS,
                beta=beta, loss_type="dapo", temperature=1.0, shuffle_dataset=False, seed=0, bf16=mixed == "bf16",
                fp16=mixed == "fp16", use_cpu=DEVICE.type == "cpu", gradient_checkpointing=False, report_to="none",
                logging_steps=1, save_strategy="no", disable_tqdm=True)


@pytest.mark.parametrize("model_dtype,mixed,mode,beta", ROWS, ids=ROW_IDS)
def test_precision_row_matches_trl(model_dtype, mixed, mode, beta, tmp_path, request):
    """TRL 1.16 trains the row's model and records every completion it samples; grpo-lab trains an identical copy on
    those completions (replayed). Loss, grad_norm and entropy of every step agree within the stated tolerances."""
    trl = pytest.importorskip("trl", reason="the TRL comparison needs trl==1.16.0 (pip install trl==1.16.0)")
    needs_device(model_dtype, mixed)
    if mode == "qlora":
        pytest.importorskip("bitsandbytes", reason="4-bit rows need bitsandbytes")
    if mixed == "fp16":
        request.getfixturevalue("t4")
    if (model_dtype, mixed, mode) in REFUSED_ROWS:
        pytest.skip("a row grpo-lab refuses at construction and the HF Trainer (and so TRL) stops on in its first step; "
                    "nothing to compare (test_precision_row_trains checks the refusal)")
    from transformers import AutoTokenizer
    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.data import arithmetic_task
    from test_learning_parity import ReplayEngine

    class OnDevice(ReplayEngine):
        "TRL's completions, replayed on the trainer's device."
        def generate(self, *args, **kwargs):
            out = super().generate(*args, **kwargs)
            moved = {f.name: getattr(out, f.name).to(DEVICE) for f in dataclasses.fields(out)
                     if isinstance(getattr(out, f.name), torch.Tensor)}
            return dataclasses.replace(out, **moved)

    data, settings = arithmetic_task(16, seed=5), trl_settings(tmp_path / "trl", mixed, beta)
    their_trainer = trl.GRPOTrainer(model=build_policy(mode, DTYPES[model_dtype], perturb_lora=beta == 0), reward_funcs=answer_and_length,
                                    args=trl.GRPOConfig(**settings), train_dataset=data,
                                    processing_class=AutoTokenizer.from_pretrained(TINY))
    batches, sample = [], their_trainer._generate

    def recording(prompts):
        out = sample(prompts)
        batches.append({"prompts": list(prompts), "prompt_ids": [list(x) for x in out[0]],
                        "completion_ids": [list(x) for x in out[1]]})
        return out

    their_trainer._generate = recording
    try:
        their_trainer.train()
    except (NotImplementedError, ValueError, RuntimeError) as e:     # seen on an H200: GradScaler and bf16 adapters
        pytest.skip(f"TRL 1.16 itself stops on this row ({type(e).__name__}: {str(e)[:200]}); nothing to compare")
    theirs = [h for h in their_trainer.state.log_history if "loss" in h and "train_runtime" not in h]

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    ours_trainer = GRPOTrainer(build_policy(mode, DTYPES[model_dtype], perturb_lora=beta == 0), answer_and_length, train_dataset=data,
                               args=GRPOConfig(**{**settings, "output_dir": str(tmp_path / "lab")}),
                               processing_class=tokenizer, engine=OnDevice(tokenizer, batches))
    ours_trainer.train()
    ours = ours_trainer.history
    assert len(ours) == len(theirs) == STEPS, (ours, theirs)
    compared = 0
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        where = f"step {step}: grpo-lab {a}, TRL {b}"
        assert abs(a["loss"] - b["loss"]) <= LOSS_ATOL + LOSS_RTOL * abs(b["loss"]), where
        assert a["entropy"] == pytest.approx(b["entropy"], rel=ENTROPY_RTOL), where
        # A step whose every group has equal rewards has no policy-gradient term: its gradient is the KL term alone
        # (zero with beta 0), log-prob differences of ~1e-5 that bf16/fp16 rounding drowns; its norm is not compared.
        if math.isfinite(b["grad_norm"]) and b["frac_reward_zero_std"] < 1:
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=GRAD_NORM_RTOL), where
            compared += 1
    assert compared, f"no step had a group with varied rewards: nothing compared ({theirs})"


# --- checkpoints ------------------------------------------------------------------------------------------------

def test_checkpoint_save_and_resume_on_cuda(tmp_path):
    """Four steps in one go, and two steps + a resume to four from the checkpoint: the same LoRA weights (the GPU's
    random state is saved and restored with the rest), the resumed trainer on the GPU. A constant learning rate: a
    decaying schedule over 2 steps, resumed to 4, would follow another curve than the straight run's."""
    from safetensors.torch import load_file
    from grpo_lab import GRPOTrainer
    from grpo_lab.data import arithmetic_task
    from grpo_lab.rewards import exact_answer
    mixed = "bf16" if DEVICE.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"

    def run(out, max_steps, resume=None):
        args = row_config(out, mixed, "lora", 0.0, save_strategy="steps", save_steps=1, lr_scheduler_type="constant")
        args.max_steps = max_steps
        trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(64), **row_shortcuts("lora"))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 4, resume=True)
    assert resumed.state.global_step == 4 and next(resumed.model.parameters()).device.type == DEVICE.type
    saved = load_file(tmp_path / "resumed" / "checkpoint-2" / "adapter_model.safetensors")
    assert saved and all(t.device.type == "cpu" for t in saved.values())      # written device-free
    a, b = trainable(straight.model), trainable(resumed.model)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)


# --- the engines ------------------------------------------------------------------------------------------------

def test_generate_and_shared_prefill_agree_on_cuda():
    "Greedy completions on the GPU are the same with and without the shared prefill (fp32 weights), on the GPU."
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from grpo_lab.models import eos_token_ids
    from grpo_lab.rollout import prefill_once_per_prompt, sample_completions, tokenize_prompts
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).to(DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    prompts = [p for p in ("12+34=", "7+5=", "40-13=") for _ in range(G)]
    ids, mask, _ = tokenize_prompts(tokenizer, prompts)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    group = torch.arange(3, device=DEVICE).repeat_interleave(G)
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_token_ids(model, tokenizer))
    assert prefill_once_per_prompt(model, ids, mask, group) is not None      # the shared path really runs
    plain = sample_completions(model, ids, mask, config, eos_token_ids(model, tokenizer), False, group)
    shared = sample_completions(model, ids, mask, config, eos_token_ids(model, tokenizer), True, group)
    for a, b in zip(plain, shared):
        assert a.device.type == DEVICE.type and torch.equal(a, b)
    assert plain[1].sum() > 0


def test_engines_in_a_training_step_on_cuda(tmp_path):
    "The default engine (shared prefill) and plain generate both feed a bf16/fp16 LoRA step on the GPU."
    from grpo_lab import GRPOTrainer
    from grpo_lab.data import arithmetic_task
    from grpo_lab.rewards import exact_answer
    from grpo_lab.rollout import GenerateEngine
    from transformers import AutoTokenizer
    mixed = "bf16" if DEVICE.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"
    for share_prefill in (None, False):
        tokenizer = AutoTokenizer.from_pretrained(TINY)
        args = row_config(tmp_path / f"share_prefill_{share_prefill}", mixed, "lora", 0.0)
        args.max_steps = 2
        trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32), processing_class=tokenizer,
                              engine=GenerateEngine(tokenizer, DEVICE, share_prefill), **row_shortcuts("lora"))
        trainer.train()
        assert len(trainer.history) == 2 and all(math.isfinite(h["loss"]) for h in trainer.history)


def test_static_engine_samples_generates_tokens_on_cuda():
    """The static-cache engine (06s_static), its decode step captured as a CUDA graph, against generate on the GPU with
    fp32 weights: greedy completions identical; seeded sampling identical on at least 3 rows in 4 (a compiled kernel
    may round differently and flip a near tie). Eager on the CPU switch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_lab.models import eos_token_ids
    from grpo_lab.rollout import GenerateEngine, SamplingSettings
    from grpo_lab.static_engine import StaticCacheEngine
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).to(DEVICE)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    rows = [{"prompt": p} for p in ("12+34=", "7+5=", "40-13=", "99-9=") for _ in range(G)]
    group = torch.arange(4).repeat_interleave(G)
    engine = StaticCacheEngine(tokenizer, DEVICE)
    assert engine.compiled == (DEVICE.type == "cuda")
    for seed, kwargs in ((0, {"do_sample": False}), (1, {}), (2, {})):
        settings = SamplingSettings(max_new_tokens=NEW_TOKENS + 3, eos_token_ids=eos_token_ids(model, tokenizer),
                                    pad_token_id=tokenizer.pad_token_id, generation_kwargs=kwargs, top_p=0.95)
        torch.manual_seed(seed)
        reference = GenerateEngine(tokenizer, DEVICE, share_prefill=True).generate(rows, group, model, settings, 0)
        torch.manual_seed(seed)
        static = engine.generate(rows, group, model, settings, 0)
        same = (reference.completion_ids == static.completion_ids).all(1)
        assert static.completion_ids.device.type == DEVICE.type
        assert same.all() if kwargs else same.float().mean() >= 0.75, (seed, same)


def test_static_engine_trains_lora_from_a_merged_copy_on_cuda(tmp_path):
    """generation_engine='auto' on the GPU picks the static engine; a LoRA policy samples from its merged half-precision
    copy, refreshed each step, and TRL's importance-sampling metrics are logged (the copy rounds differently)."""
    from grpo_lab import GRPOTrainer
    from grpo_lab.data import arithmetic_task
    from grpo_lab.rewards import exact_answer
    from grpo_lab.static_engine import StaticCacheEngine
    mixed = "bf16" if DEVICE.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"
    args = row_config(tmp_path, mixed, "lora", 0.0)
    args.max_steps = 2
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32), **row_shortcuts("lora"))
    assert isinstance(trainer.engine, StaticCacheEngine) == (DEVICE.type == "cuda")
    trainer.train()
    assert len(trainer.history) == 2 and all(math.isfinite(h["loss"]) for h in trainer.history)
    if DEVICE.type == "cuda":
        assert trainer.engine.merged_copy and trainer.engine.copy.version == 1 and trainer.samples_elsewhere
        assert all("sampling/sampling_logp_difference/mean" in h for h in trainer.history), trainer.history[-1]


def test_tool_loop_on_cuda():
    """The multi-turn tool loop with a real model on the GPU: one rollout's first turn is a scripted call of
    `multiply` (a random model never writes one), everything else is sampled on the GPU; the outputs live there."""
    from transformers import GenerationConfig
    from grpo_lab.models import random_tiny_model, tiny_tokenizer
    from grpo_lab.rollout import SamplingSettings
    from grpo_lab.tools import ToolLoopEngine, multiply
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 3}}\n</tool_call><|im_end|>'

    class HalfScripted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = random_tiny_model(len(tokenizer), max_position_embeddings=4096).to(DEVICE)
            self.rounds = 0

        def generate(self, input_ids, attention_mask, generation_config: GenerationConfig):
            assert input_ids.device.type == DEVICE.type
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=generation_config)
            self.rounds += 1
            if self.rounds > 1:
                return out
            scripted = torch.tensor(tokenizer(call, add_special_tokens=False).input_ids, device=DEVICE)
            new = torch.full((out.size(0), max(out.size(1) - input_ids.size(1), len(scripted))), tokenizer.pad_token_id,
                             device=DEVICE)
            new[:, : out.size(1) - input_ids.size(1)] = out[:, input_ids.size(1):]
            new[0] = tokenizer.pad_token_id
            new[0, : len(scripted)] = scripted
            return torch.cat([input_ids, new], dim=1)

    policy = HalfScripted()
    settings = SamplingSettings(max_new_tokens=240, eos_token_ids=[tokenizer.eos_token_id],
                                pad_token_id=tokenizer.pad_token_id)
    rows = [{"prompt": [{"role": "user", "content": f"What is 12 times 3? ({i})"}]} for i in range(2)]
    out = ToolLoopEngine(tokenizer, tools=[multiply]).generate(rows, torch.arange(2), policy, settings, 0)
    assert policy.rounds == 2                           # the calling rollout was sampled again after the result
    assert out.completion_ids.device.type == DEVICE.type and out.tool_mask.device.type == DEVICE.type
    assert out.metrics["tools/call_frequency"] == pytest.approx(1 / 2)
    messages = out.extra["completion_messages"][0]
    assert [m["role"] for m in messages[:2]] == ["assistant", "tool"] and messages[1]["content"] == "36"
    inserted = out.completion_ids[0][(out.completion_mask[0] == 1) & (out.tool_mask[0] == 0)]
    assert "36" in tokenizer.decode(inserted)


# --- the memory estimate against the measured peak --------------------------------------------------------------

MEMORY_ROWS = {   # settings of estimate_memory; each trains the random-weight Qwen2.5-0.5B shape for one step
    "qlora-gc-8x256+256": dict(load_in_4bit=True, lora_r=16, gradient_checkpointing=True, per_device_train_batch_size=8,
                               num_generations=8, max_prompt_length=256, max_completion_length=256),
    "bf16-lora-16x64+128": dict(load_in_4bit=False, lora_r=16, gradient_checkpointing=False,
                                per_device_train_batch_size=16, num_generations=8, max_prompt_length=64,
                                max_completion_length=128),
}
MEMORY_RTOL = 0.15


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY_ROWS))
def test_memory_estimate_within_15_percent_of_the_measured_peak(name, tmp_path):
    """`estimate_memory` against `torch.cuda.max_memory_allocated` over one GRPO step of the same settings, every
    completion of full length (EOS held back): within 15%. GPU only (the CPU has no allocator peak to compare)."""
    if DEVICE.type != "cuda":
        pytest.skip("the measured peak is torch.cuda.max_memory_allocated: CUDA only")
    settings = MEMORY_ROWS[name]
    if settings["load_in_4bit"]:
        pytest.importorskip("bitsandbytes", reason="4-bit rows need bitsandbytes")
    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.bench import BenchSettings, even_token_reward, load_tokenizer, prepare_model, synthetic_prompts
    from grpo_lab.memory import estimate_memory, model_config
    from datasets import Dataset
    folder = prepare_model(BenchSettings(shape="qwen2.5-0.5b"), tmp_path / "model")
    tokenizer = load_tokenizer(folder)
    n_prompts = settings["per_device_train_batch_size"] // settings["num_generations"]
    prompts = synthetic_prompts(tokenizer, n_prompts, settings["max_prompt_length"])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True, logging_steps=1,
                      gradient_checkpointing=settings["gradient_checkpointing"],
                      per_device_train_batch_size=settings["per_device_train_batch_size"],
                      num_generations=settings["num_generations"], max_prompt_length=settings["max_prompt_length"],
                      max_completion_length=settings["max_completion_length"],
                      generation_kwargs={"min_new_tokens": settings["max_completion_length"]})
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(str(folder), even_token_reward, args=args, processing_class=tokenizer,
                          lora_r=settings["lora_r"], load_in_4bit=settings["load_in_4bit"],
                          train_dataset=Dataset.from_dict({"prompt": prompts}))
    trainer.train()
    measured = torch.cuda.max_memory_allocated() / 2**30
    estimate = estimate_memory(model_config("Qwen/Qwen2.5-0.5B-Instruct"), **settings).total
    print(f"{name}: measured {measured:.2f} GiB, estimated {estimate:.2f} GiB ({estimate / measured - 1:+.1%})")
    assert estimate == pytest.approx(measured, rel=MEMORY_RTOL), (measured, estimate)


# --- the demo learns on the GPU ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_tiny_demo_learns_on_cuda(tmp_path):
    "`grpo-lab demo`'s recipe, shortened, on the GPU: held-out greedy accuracy rises (700 steps: +24-26 points on CPU)."
    from grpo_lab.cli import run_demo
    summary = run_demo(tmp_path / "demo", steps=300, eval_size=500, eval_every=150, quiet=True)
    assert summary["steps"] == 300
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
