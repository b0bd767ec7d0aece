"""Every precision a CPU can run trains, and where TRL 1.16 trains a cell, grpo-lab's first step matches TRL's.

The matrix (issue 30): the model's dtype {float32, bfloat16, float16} x the run's mixed precision {`bf16=True`,
`fp16=True`, unset, `bf16=False`} x {full fine-tuning, LoRA, LoRA on a 4-bit base loaded TRL's way
(`model_init_kwargs={"quantization_config": BitsAndBytesConfig(...)}`)} x {beta 0, beta 0.04 (a reference policy)}
x {the `generate` engine, the tool loop}. Every cell is one script with only the import changed: the same
`GRPOConfig` fields, the same `GRPOTrainer(model=path, ..., peft_config=...)` call.

- `test_every_cell_trains` runs grpo-lab on every cell (the tool loop on the LoRA cells): one optimizer step, a finite
  loss, gradient norm and entropy, and weights that moved. One cell is refused in a sentence instead: a float16 model
  on a 4-bit base under bf16 autocast, where torch's autocast meets two half precisions in one op (TRL 1.16 crashes
  there with "Unexpected floating ScalarType").
- `test_first_step_matches_trl` runs TRL 1.16 and grpo-lab side by side on the cells TRL trains on a CPU: TRL's
  completions are replayed into grpo-lab (sampling is the only random part of a step), and the logged loss, gradient
  norm and entropy of the first step must agree within the precision's tolerance (below).

On a CPU, mixed precision is bf16 autocast (accelerate); `fp16=True` is what a T4 runs, and the GPU tests
(tests/test_cuda.py) cover it there.
"""
import math
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from transformers import BitsAndBytesConfig  # noqa: E402

from grpo_lab import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo_lab.models import tiny_eval_problems, tiny_model_path  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
FLAGS = ("bf16", "fp16", "unset", "off")
# grpo-lab resolves bf16=None to float32 on a CPU where TRL picks bf16 (on purpose: bf16 only where the hardware has
# it), so "unset" is compared with TRL's bf16=False; fp16=True on a CPU runs in float32 in both (accelerate has no
# CPU fp16 autocast), which is what the GPU tests check on CUDA.
PARITY_FLAGS = {"bf16": "bf16", "fp16": "fp16", "unset": "off", "off": "off"}
KINDS = ("full", "lora", "4bit")
BETAS = (0.0, 0.04)
# Tolerances of grpo-lab's first step against TRL's, relative (grad norm) or absolute (entropy, nats per token).
# float32 everywhere: both compute the same sums in another order (grpo-lab applies the LM head to the final hidden
# states a tile at a time, TRL asks the model for the logits): measured gaps ~1e-6. Any half precision (a bf16 or fp16
# model, or bf16 autocast): the head's matmul runs in that precision in both, but TRL takes a bf16 model's log-softmax
# in bf16 (8 significant bits) where grpo-lab takes it in float32, and the 4-bit cells dequantize in that precision:
# measured gaps up to ~1e-2. A wrong dtype at a stage (a KL between two precisions, a log-prob left in bf16) shows as
# a nonzero KL at step 1 or a grad-norm gap of 10% and more.
TOLERANCE = {"full": 1e-4, "half": 3e-2}


def reward(completions, answer, **kwargs):
    "Varied within a group: the answer appears (1), minus the length over 50 characters."
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(a in t) - len(t) / 50 for t, a in zip(texts, answer)]


def dataset(conversational: bool = False):
    from datasets import Dataset
    as_prompt = (lambda p: [{"role": "user", "content": p}]) if conversational else (lambda p: p)
    return Dataset.from_list([{"prompt": as_prompt(r["prompt"]), "answer": r["answer"]} for r in tiny_eval_problems(8)])


def config_kwargs(output_dir, dtype, flag, kind, beta) -> dict:
    "The script's GRPOConfig fields for one cell (the same names in TRL and grpo-lab)."
    init = {"dtype": dtype}
    if kind == "4bit":
        init["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_compute_dtype=getattr(torch, dtype))
    kwargs = dict(output_dir=str(output_dir), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, use_cpu=True, report_to="none", logging_steps=1,
                  save_strategy="no", beta=beta, model_init_kwargs=init, disable_tqdm=True, seed=0,
                  learning_rate=1e-3, gradient_checkpointing=False)
    if flag in ("bf16", "off"):
        kwargs["bf16"] = flag == "bf16"
    elif flag == "fp16":
        kwargs["fp16"] = True
    return kwargs


def peft_config(kind):
    return None if kind == "full" else peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                       task_type="CAUSAL_LM")


def trainable(model) -> dict:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def first_step(log_history) -> dict:
    return next(entry for entry in log_history if "grad_norm" in entry)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


CELLS = [(d, f, k, b, "generate") for d in DTYPES for f in FLAGS for k in KINDS for b in BETAS]
# the tool loop needs a chat template that renders tool calls: SmolLM2's tokenizer (ChatML) on a small random model
CELLS += [("float32", "bf16", "lora", 0.04, "tools"), ("bfloat16", "off", "lora", 0.04, "tools"),
          ("float16", "off", "lora", 0.04, "tools")]


@pytest.fixture(scope="module")
def chatml_model(smollm2_folder, tmp_path_factory):
    "A 2-layer random model (hidden 64) with SmolLM2's tokenizer and chat template, which render tool calls."
    from transformers import AutoTokenizer
    from grpo_lab.models import random_tiny_model
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    folder = tmp_path_factory.mktemp("chatml")
    model = random_tiny_model(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype,flag,kind,beta,engine", CELLS, ids=lambda v: str(v))
def test_every_cell_trains(request, tmp_path, dtype, flag, kind, beta, engine):
    args = GRPOConfig(**config_kwargs(tmp_path, dtype, flag, kind, beta))
    model = request.getfixturevalue("chatml_model") if engine == "tools" else tiny_model_path()
    if (dtype, flag, kind) == ("float16", "bf16", "4bit"):    # TRL 1.16 fails here too (torch's autocast refuses)
        with pytest.raises(ValueError, match=r"bf16=True with a 4-bit base whose embeddings and norms are float16"):
            GRPOTrainer(model=str(model), reward_funcs=reward, args=args, train_dataset=dataset(),
                        peft_config=peft_config(kind))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=str(model), reward_funcs=reward, args=args,
                              train_dataset=dataset(conversational=engine == "tools"),
                              peft_config=peft_config(kind), tools=[multiply] if engine == "tools" else None)
    before = trainable(trainer.model)
    trainer.train()
    log = first_step(trainer.state.log_history)
    assert all(math.isfinite(log[k]) for k in ("loss", "grad_norm", "entropy")), log
    assert log["grad_norm"] > 0, log
    if beta > 0:      # step 1: the policy is the reference, at the same precision, so the KL is 0 up to rounding
        assert abs(log["kl"]) < 1e-3, log
    after = trainable(trainer.model)
    moved = sum(not torch.equal(before[n], after[n]) for n in before)
    assert moved > 0, f"no trainable tensor moved in one optimizer step ({len(before)} trainable)"
    weight = next(p for n, p in trainer.model.named_parameters() if "q_proj" in n and "lora" not in n)
    if kind != "4bit":
        assert weight.dtype == getattr(torch, dtype), (weight.dtype, dtype)


@pytest.fixture(scope="module")
def trl():
    return pytest.importorskip("trl")


PARITY_CELLS = [(d, f, k, 0.04) for d in DTYPES for f in ("bf16", "fp16", "unset") for k in KINDS]


@pytest.mark.parametrize("dtype,flag,kind,beta", PARITY_CELLS, ids=lambda v: str(v))
def test_first_step_matches_trl(trl, tmp_path, dtype, flag, kind, beta):
    from test_learning_parity import ReplayEngine

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)      # LoRA's A matrices are random: both trainers draw them from the same state
        theirs = trl.GRPOTrainer(model=str(tiny_model_path()), reward_funcs=reward, train_dataset=dataset(),
                                 args=trl.GRPOConfig(**config_kwargs(tmp_path / "trl", dtype, PARITY_FLAGS[flag], kind,
                                                                     beta)),
                                 peft_config=peft_config(kind))
    batches, sample = [], theirs._generate

    def recording(prompts):
        out = sample(prompts)
        batches.append({"prompts": prompts, "prompt_ids": [list(x) for x in out[0]],
                        "completion_ids": [list(x) for x in out[1]]})
        return out

    theirs._generate = recording
    initial = trainable(theirs.model)
    try:
        theirs.train()
    except RuntimeError as e:      # grpo-lab trains this cell (test_every_cell_trains); there is no TRL step to match
        pytest.skip(f"TRL 1.16 does not train this cell on a CPU: {e}")
    trl_log = first_step(theirs.state.log_history)

    args = GRPOConfig(**config_kwargs(tmp_path / "lab", dtype, flag, kind, beta))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        ours = GRPOTrainer(model=str(tiny_model_path()), reward_funcs=reward, args=args, train_dataset=dataset(),
                           peft_config=peft_config(kind), engine=ReplayEngine(theirs.processing_class, batches))
    start = trainable(ours.model)
    assert sorted(start) == sorted(initial)
    params = dict(ours.model.named_parameters())
    for name in initial:     # the same starting point: the same load, the same adapter draw
        if kind == "4bit":   # TRL casts a quantized model's adapter to bf16; grpo-lab keeps it in float32 (on purpose)
            torch.testing.assert_close(start[name].bfloat16().float(), initial[name], rtol=0, atol=0, msg=name)
            with torch.no_grad():
                params[name].copy_(initial[name])      # the same values, each in its trainer's dtype
        else:
            torch.testing.assert_close(start[name], initial[name], rtol=0, atol=0, msg=name)
    ours.train()
    lab_log = first_step(ours.state.log_history)
    half = dtype != "float32" or flag == "bf16" or kind == "4bit"
    tol = TOLERANCE["half" if half else "full"]
    assert lab_log["loss"] == pytest.approx(trl_log["loss"], abs=tol), (lab_log, trl_log)
    assert lab_log["entropy"] == pytest.approx(trl_log["entropy"], abs=tol * 3), (lab_log, trl_log)
    assert lab_log["grad_norm"] == pytest.approx(trl_log["grad_norm"], rel=tol * 3), (lab_log, trl_log)


@pytest.fixture
def a_t4(monkeypatch):
    "This process sees a Tesla T4 (no GPU here: torch.cuda answers as it does on Colab's free GPU)."
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)


def test_bf16_on_a_t4_is_refused_with_the_fix(tmp_path, a_t4):
    from grpo_lab.config import _resolve_bf16
    with pytest.raises(ValueError, match=r"bf16=True on Tesla T4 \(compute capability 7.5\).*fp16=True"):
        _resolve_bf16(True, False, False)
    assert _resolve_bf16(None, False, False) is False       # the default never picks emulated bf16
    assert _resolve_bf16(None, True, False) is False
    assert _resolve_bf16(True, False, True) is True         # use_cpu: the CPU's bf16 autocast, whatever the GPU


def test_bf16_default_on_an_ampere_gpu(monkeypatch):
    from grpo_lab.config import _resolve_bf16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert _resolve_bf16(None, False, False) is True
    assert _resolve_bf16(None, True, False) is False


def test_a_trained_adapter_is_its_own_reference(tmp_path):
    "A PeftModel with a trained adapter and beta > 0: the reference is a frozen copy of that adapter (TRL's 'ref'),"
    "so the KL is 0 at step 1; the base model with the adapter disabled would put it far from 0."
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    model = peft.get_peft_model(base, peft_config("lora"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)          # a trained adapter: it changes the base model's outputs
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B.default" in n}
    args = GRPOConfig(**config_kwargs(tmp_path, "float32", "off", "lora", 0.04) | {"model_init_kwargs": None})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset())
    assert "ref" in model.peft_config and model.active_adapter == "default"
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".ref." in n)
    trainer.train()
    log = first_step(trainer.state.log_history)
    assert abs(log["kl"]) < 1e-6, log
    assert model.active_adapter == "default"
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_B.default" in n)
    reference = {n: p for n, p in model.named_parameters() if "lora_B.ref" in n}
    for name, weight in trained.items():       # the reference stayed where training started
        torch.testing.assert_close(reference[name.replace(".default.", ".ref.")], weight, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_loss_scaling_over_half_precision_weights_is_refused_with_the_fix(dtype):
    """fp16=True on a GPU scales the loss with a GradScaler, which cannot unscale float16 or bfloat16 gradients (seen
    on an H200: both stop the first step, in the HF Trainer and TRL too). The check the trainer runs at construction,
    with the scaler a GPU would have: full fine-tuning of a half model is refused naming the dtype and the fixes; a
    float32 model, or a frozen half model with float32 trainable weights, passes."""
    from transformers import AutoModelForCausalLM
    from grpo_lab.assemble import check_half_precisions
    from grpo_lab.models import tiny_model_path
    half = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=dtype)
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"^fp16=True scales the loss, and torch's GradScaler cannot unscale {name} "
                                         r"gradients: .*float32.*LoRA.*bf16=True"):
        check_half_precisions(half, torch.float16, scales_loss=True)
    check_half_precisions(half, torch.float16, scales_loss=False)            # a CPU: no scaler, it trains
    for p in half.parameters():
        p.requires_grad_(False)
    half.get_output_embeddings().float().requires_grad_(True)
    check_half_precisions(half, torch.float16, scales_loss=True)
    check_half_precisions(AutoModelForCausalLM.from_pretrained(tiny_model_path()), torch.float16, scales_loss=True)
