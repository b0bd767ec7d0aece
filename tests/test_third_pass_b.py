"""Issue 41, items 2 and 6: the hub as TRL pushes to it (against a local stand-in for the hub's API), every
GRPOConfig field read somewhere, and a run's terminal for people."""
import dataclasses
import re
from pathlib import Path

import huggingface_hub.constants
import pytest

from grpo_lab import GRPOConfig, GRPOTrainer
from grpo_lab.data import arithmetic_task
from grpo_lab.hub import HubError, LocalHub, model_files
from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer

TINY = str(tiny_model_path())
ROOT = Path(__file__).resolve().parents[1]


def small_args(out, **kw) -> GRPOConfig:
    return GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                      learning_rate=1e-3, logging_steps=1, disable_tqdm=True, gradient_checkpointing=False, **kw)


@pytest.fixture
def hub(monkeypatch):
    "A stand-in for the hub's HTTP API on localhost; HF_HUB_OFFLINE lifted for it alone (HF_ENDPOINT points there)."
    with LocalHub() as local:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", local.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", "/nonexistent/token")
        yield local


# --- the hub ---------------------------------------------------------------------------------------------------------

def test_push_to_hub_without_a_token_or_offline_stops_at_construction_in_one_sentence(tmp_path, hub, monkeypatch):
    "grpo-lab trained and pushed nothing (issue 41); TRL stops at construction, offline. So does grpo-lab, saying why."
    with pytest.raises(HubError, match=r"push_to_hub=True needs a Hugging Face token .* 'me/tiny-grpo'.*hf auth login"):
        GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, push_to_hub=True, hub_model_id="me/tiny-grpo"),
                    train_dataset=arithmetic_task(32))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubError, match=r"HF_HUB_OFFLINE=1 is set.*push_to_hub=False") as e:
        GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, push_to_hub=True, hub_model_id="me/tiny-grpo",
                                                        hub_token="hf_test"), train_dataset=arithmetic_task(32))
    assert len(str(e.value)) < 400 and not hub.repos
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")     # nothing listens there
    with pytest.raises(HubError, match=r"http://127.0.0.1:9 cannot be reached \(ConnectError"):
        GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, push_to_hub=True, hub_token="hf_test"),
                    train_dataset=arithmetic_task(32))


@pytest.mark.parametrize("strategy,folder", [("checkpoint", "last-checkpoint"), ("all_checkpoints", None)])
def test_each_save_pushes_the_files_saved_as_hub_strategy_says(tmp_path, hub, strategy, folder):
    "The repository gets, at each save, that save's model files at its root and its checkpoint in the strategy's folder."
    args = small_args(tmp_path, push_to_hub=True, hub_model_id="me/tiny-grpo", hub_token="hf_test", max_steps=2,
                      save_strategy="steps", save_steps=1, hub_strategy=strategy, hub_always_push=True)
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32), lora_r=8)
    assert hub.repos == {"me/tiny-grpo": False} and trainer.hub_model_id == "me/tiny-grpo"    # at construction
    trainer.train()
    assert [c["message"] for c in hub.commits] == ["Training in progress, step 1", "Training in progress, step 2"]
    for step, commit in enumerate(hub.commits, 1):
        checkpoint = tmp_path / f"checkpoint-{step}"
        root = {p: b for p, b in commit["files"].items() if "/" not in p}
        assert root.keys() == {p.name for p in model_files(checkpoint)} | {"README.md"}
        assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= root.keys()   # the adapter
        assert [p.name for p in model_files(checkpoint) if root[p.name] != p.read_bytes()] == []   # byte for byte, that save's
        in_folder = {p.split("/", 1)[1]: b for p, b in commit["files"].items() if p.startswith(f"{folder or checkpoint.name}/")}
        assert in_folder == {p.name: p.read_bytes() for p in checkpoint.iterdir()}     # the whole checkpoint
    assert b"- grpo" in hub.commits[-1]["files"]["README.md"]
    assert not list(tmp_path.glob("_hub-push-*"))                                      # snapshots removed
    trainer.push_to_hub(dataset_name="arithmetic")                                      # TRL's scripts, at the end
    final = hub.commits[-1]
    assert final["message"] == "End of training" and "arithmetic" in final["files"]["README.md"].decode()
    assert {"adapter_model.safetensors", "adapter_config.json", "training_args.bin"} <= final["files"].keys()
    assert not any(p.startswith(("checkpoint-", "_hub", "completions")) or p.endswith(".jsonl") for p in final["files"])


def test_hub_strategy_end_pushes_when_the_model_is_saved(tmp_path, hub):
    "hub_strategy='end' pushes nothing at saves, and save_model() pushes, as in the HF Trainer."
    args = small_args(tmp_path, push_to_hub=True, hub_token="hf_test", max_steps=1, save_strategy="steps", save_steps=1,
                      hub_strategy="end")
    trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32))
    trainer.train()
    assert hub.commits == [] and trainer.hub_model_id == f"local-user/{tmp_path.name}"
    trainer.save_model()
    assert [c["message"] for c in hub.commits] == ["Model save"]
    assert {"model.safetensors", "config.json", "README.md"} <= hub.commits[0]["files"].keys()
