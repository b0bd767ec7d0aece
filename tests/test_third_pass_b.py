"""Issue 41, items 2 and 6: the hub as TRL pushes to it (against a local stand-in for the hub's API), every
GRPOConfig field read somewhere, and a run's terminal for people."""
import dataclasses
import json
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
    kw = {"disable_tqdm": True, "gradient_checkpointing": False, **kw}
    return GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=5,
                      learning_rate=1e-3, logging_steps=1, **kw)


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


# --- every GRPOConfig field is read somewhere -----------------------------------------------------------------------

def _grpo_lab_reads() -> str:
    "grpo_lab's source, less the places that only name fields (the field declarations, the refused and no-effect lists)."
    text = ""
    for path in sorted((ROOT / "grpo_lab").glob("*.py")):
        if path.name == "_modidx.py":
            continue
        source = path.read_text()
        for table in ("REFUSED_OPTIONS = {", "WITHOUT_EFFECT = {"):
            if table in source:
                start = source.index(table)
                source = source[:start] + source[source.index("\n}\n", start):]
        text += source
    return text


def _transformers_readers() -> dict:
    "Inherited fields that transformers' own code reads, in the parts grpo-lab runs: field -> that code."
    from transformers import Trainer, TrainingArguments, trainer_optimizer
    from transformers.integrations import integration_utils
    from transformers.trainer_callback import DefaultFlowCallback
    flow, post_init, optimizer = DefaultFlowCallback, TrainingArguments.__post_init__, Trainer.get_optimizer_cls_and_kwargs
    return {"logging_strategy": flow, "logging_first_step": flow, "eval_strategy": flow, "eval_delay": flow,
            "run_name": integration_utils, "project": integration_utils, "trackio_space_id": integration_utils,
            "trackio_bucket_id": integration_utils, "trackio_static_space_id": integration_utils,
            "optim_args": optimizer, "optim_target_modules": trainer_optimizer,      # the optimizer's handlers
            "activation_checkpointing": post_init, "tf32": post_init,        # mirrored to gradient_checkpointing; torch's
            "torch_compile_backend": post_init, "torch_compile_mode": post_init,   # they set torch_compile (refused)
            # mirrored to gradient_checkpointing_kwargs, which grpo-lab reads (the name older transformers have too)
            "activation_checkpointing_kwargs": post_init,
            # the process group, which GRPOConfig's own __post_init__ starts (grpo-lab's Accelerator then uses it)
            "ddp_backend": TrainingArguments._setup_devices.func, "ddp_timeout": TrainingArguments._setup_devices.func}


# transformers' own words for these: "not directly used by Trainer, it's intended to be used by your training/evaluation
# scripts instead"; grpo-lab's scripts (06i_scripts) do the same as TRL's.
FOR_SCRIPTS = {"do_train", "do_eval", "do_predict", "resume_from_checkpoint"}
# TRL fields owned by another issue and not read yet (ds3_gather_for_generation, once listed here, is read by 06p_sharded).
OWNED_ELSEWHERE: set[str] = set()


def test_every_grpoconfig_field_is_honoured_refused_or_explained():
    "Walk all of GRPOConfig's fields: read in grpo_lab, refused, listed without effect (with a reason), or read by transformers."
    import inspect
    from transformers import TrainingArguments
    from grpo_lab.config import REFUSED_OPTIONS, WITHOUT_EFFECT
    reads, readers = _grpo_lab_reads(), _transformers_readers()
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    unread = []
    for field in dataclasses.fields(GRPOConfig):
        name = field.name
        if re.search(rf"\.{name}\b|[\"']{name}[\"']", reads) or name in REFUSED_OPTIONS or name in WITHOUT_EFFECT:
            continue
        if name in readers:
            # (read as an attribute, or by name: __post_init__ mirrors the checkpointing aliases through getattr/setattr)
            assert re.search(rf"\.{name}\b|[\"']{name}[\"']", inspect.getsource(readers[name])), \
                f"{name}: its reader no longer reads it"
            continue
        if name in OWNED_ELSEWHERE or (name in inherited and name in FOR_SCRIPTS):
            continue
        unread.append(name)
    assert unread == [], f"GRPOConfig fields read nowhere (honour them, refuse them, or list them with a reason): {unread}"
    stale = {n for n in OWNED_ELSEWHERE if re.search(rf"\.{n}\b", reads)}
    assert stale == set(), f"now read by grpo_lab, drop them from OWNED_ELSEWHERE: {stale}"



# the HF Trainer's options, as a TRL script sets them: each refused in a sentence when set, its default accepted
REFUSED_SETTINGS = {"train_sampling_strategy": "group_by_length", "dataloader_drop_last": True, "ignore_data_skip": True,
                    "save_only_model": True, "save_on_each_node": True, "restore_callback_states_from_checkpoint": True,
                    "enable_jit_checkpoint": True, "bf16_full_eval": True, "fp16_full_eval": True,
                    "skip_memory_metrics": False, "logging_nan_inf_filter": False,
                    "parallelism_config": {"tp_size": 2}}


def test_the_hf_trainers_options_grpo_lab_does_not_run_are_refused_when_set_and_accepted_at_their_defaults(tmp_path):
    "Accepted and ignored before (issue 41): a value that would change an HF Trainer run is refused; TRL's default passes."
    from grpo_lab.config import REFUSED_OPTIONS
    from trl import GRPOConfig as TRLGRPOConfig
    assert REFUSED_SETTINGS.keys() <= REFUSED_OPTIONS.keys()
    trl = TRLGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    trl_defaults = {name: getattr(trl, name) for name in REFUSED_SETTINGS}
    small_args(tmp_path, **trl_defaults)            # what TrlParser passes when the script's user sets none of them
    for name, value in REFUSED_SETTINGS.items():
        with pytest.raises(ValueError, match=rf"^{name}=.* is not supported by grpo-lab: .+"):
            small_args(tmp_path, use_cpu=True, **{name: value})     # (on the CPU transformers lets *_full_eval through)


def test_dataloader_ddp_log_level_determinism_and_checkpointing_options_reach_what_they_set(tmp_path):
    "dataloader_*, ddp_*, log_level, full_determinism and gradient_checkpointing_kwargs take effect (issue 41)."
    import logging
    import torch
    from grpo_lab.sharded import ddp_options
    logger, before = logging.getLogger("grpo_lab"), logging.getLogger("grpo_lab").level
    try:
        args = small_args(tmp_path, max_steps=1, dataloader_pin_memory=False, dataloader_num_workers=1,
                          dataloader_persistent_workers=True, dataloader_prefetch_factor=3, log_level="error",
                          full_determinism=True, gradient_checkpointing=True,
                          gradient_checkpointing_kwargs={"use_reentrant": True, "every_n_layers": 2})
        trainer = GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32))
        assert logger.level == logging.ERROR and torch.are_deterministic_algorithms_enabled()
        loader = trainer.get_train_dataloader()
        assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (1, True, 3)
        assert len(next(iter(loader))) == 8 and trainer.get_eval_dataloader(arithmetic_task(8)).prefetch_factor == 3
        layers = [m for m in trainer.model.modules() if hasattr(m, "_gradient_checkpointing_func")]
        assert layers and all(m._gradient_checkpointing_func.keywords == {"use_reentrant": True} for m in layers)
        from transformers.modeling_layers import GradientCheckpointingLayer
        blocks = [m.gradient_checkpointing for m in layers if isinstance(m, GradientCheckpointingLayer)]
        assert len(blocks) >= 2 and blocks == [i % 2 == 0 for i in range(len(blocks))]    # every other decoder layer
    finally:
        logger.setLevel(before)
        torch.use_deterministic_algorithms(False)
    from grpo_lab.steps import loader_options
    pinned, unpinned, on_cpu = small_args(tmp_path), small_args(tmp_path, dataloader_pin_memory=False), \
        small_args(tmp_path, use_cpu=True)
    with pytest.MonkeyPatch.context() as gpu:              # pinned where a GPU is (a CPU run pins nothing: torch warns)
        gpu.setattr(torch.cuda, "is_available", lambda: True)
        assert [loader_options(a)["pin_memory"] for a in (pinned, unpinned, on_cpu)] == [True, False, False]
    (handler,) = ddp_options(small_args(tmp_path, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=50,
                                         ddp_broadcast_buffers=False, ddp_static_graph=True))
    assert handler.to_kwargs() == {"find_unused_parameters": True, "bucket_cap_mb": 50, "broadcast_buffers": False,
                                   "static_graph": True}
    assert ddp_options(small_args(tmp_path)) == []          # none set: accelerate's defaults, as before


def test_log_unique_prompts_is_refused_and_log_multimodal_read():
    """Both were accepted and ignored (issue 41): one is refused in a sentence; the other is read by the trainer since
    issue 44 (pictures in TRL's `_logs["images"]`: tests/test_vision.py), so it is no longer listed as without effect."""
    from grpo_lab.config import WITHOUT_EFFECT
    with pytest.raises(ValueError, match=r"log_unique_prompts=True is not supported .*drop_duplicates"):
        small_args("out-unused", log_unique_prompts=True)
    assert "log_multimodal" not in WITHOUT_EFFECT


# --- a run's terminal ----------------------------------------------------------------------------------------------

def _grpo_lab_deprecations(run) -> list[str]:
    "Run `run()`; the FutureWarnings and DeprecationWarnings raised while grpo_lab code was on the stack."
    import traceback
    import warnings
    package, found = str(ROOT / "grpo_lab"), []

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(package)]
        if issubclass(category, (FutureWarning, DeprecationWarning)) and ours:
            found.append(f"{category.__name__}: {str(message)[:120]} (from {Path(ours[-1].filename).name}:{ours[-1].lineno})")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        run()
    return found


def test_a_run_prints_a_bar_and_one_line_per_log_and_no_deprecation_of_its_own(tmp_path, capsys):
    "TRL's 25-key dicts (every value a string), checkpoint bars and a FutureWarning made a wall (issue 41): now a line a log."
    args = small_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, gradient_checkpointing=True,
                      disable_tqdm=False)
    trainer = []
    deprecations = _grpo_lab_deprecations(lambda: trainer.append(
        GRPOTrainer(TINY, exact_answer, args=args, train_dataset=arithmetic_task(32), lora_r=8).train()))
    assert deprecations == []       # it was: gradient_checkpointing_enable is deprecated (transformers 5.24)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 3 and lines[2].startswith("[done, step 2/2] ") and "{" not in out
    for step, line in enumerate(lines[:2], 1):
        assert re.fullmatch(rf"\[step {step}/2\] reward \d\.\d{{3}} ± \d\.\d{{3}} \| length \d+\.\d \| entropy \d\.\d{{3}} \| "
                            r"\d+\.\d\d s/step", line), line
    assert "Writing model shards" not in err and "2/2" in err          # the checkpoints' bars off; the run's bar there
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert min(len(entry) for entry in logged[:2]) >= 20                # the full metrics, as before


def test_trls_printed_dicts_stay_one_setting_away(tmp_path, capsys):
    GRPOTrainer(TINY, exact_answer, args=small_args(tmp_path, max_steps=1, log_format="trl"),
                train_dataset=arithmetic_task(32)).train()
    out = capsys.readouterr().out
    assert out.startswith("{'loss': ") and "'reward_std': " in out
    with pytest.raises(ValueError, match="log_format='dicts': choose 'compact'"):
        small_args(tmp_path, log_format="dicts")


def test_grpo_lab_demo_terminal_is_a_line_per_log_with_held_out_accuracy(tmp_path, capsys):
    "`grpo-lab demo`: one bar, a line per log with the held-out accuracy where measured; no library bars."
    from transformers.utils import logging as transformers_logging
    from grpo_lab.cli import main
    try:
        assert main(["demo", "--steps", "1", "--eval-size", "20", "--eval-every", "1",
                     "--output-dir", str(tmp_path / "demo")]) == 0
    finally:
        transformers_logging.enable_progress_bar()
        import datasets
        datasets.enable_progress_bars()
    out, err = capsys.readouterr()
    assert re.search(r"^\[step 1/1\] reward .* \| held-out \d+\.\d% \| ", out, re.M) and "{'" not in out
    assert "held-out greedy accuracy after 1 steps" in out
    assert not re.search("Writing model shards|Loading weights|Filter", err)
