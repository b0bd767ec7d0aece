"""TRL's script patterns run on grpo-lab with only the import changed: the command line parsed by `TrlParser`, the
model loaded from `ModelConfig` and `model_init_kwargs`, a `PeftModel` passed in, and the calls scripts make after
`train()`. Each test is written from the pattern, not copied from a public script."""
import json
import math

import pytest
import torch

from grpo_lab.models import tiny_model_path
from grpo_lab.rewards import exact_answer

TINY = str(tiny_model_path())


@pytest.fixture
def dataset_folder(tmp_path):
    "A local dataset folder with a train and a test split, as `load_dataset(script_args.dataset_name)` reads it."
    from grpo_lab.data import arithmetic_task
    folder = tmp_path / "arith"
    folder.mkdir()
    for split, n, seed in (("train", 32, 0), ("test", 8, 1)):
        rows = arithmetic_task(n, seed=seed).to_list()
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def argv(out, data, *extra):
    "A TRL-style command line: dataset, model, a few GRPO options and the `extra` ones."
    return ["--output_dir", str(out), "--dataset_name", str(data), "--model_name_or_path", TINY,
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "5",
            "--max_steps", "3", "--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no",
            "--report_to", "none", "--disable_tqdm", "true", "--gradient_checkpointing", "false", *extra]


def run_script(parser_cls, script_cls, config_cls, model_cls, peft_config_of, argv_list):
    "The body of TRL's grpo.py: parse, fold the model options into model_init_kwargs, load data, train."
    from datasets import load_dataset
    from grpo_lab import GRPOTrainer
    script_args, training_args, model_args = parser_cls((script_cls, config_cls, model_cls)).parse_args_and_config(
        argv_list)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    trainer = GRPOTrainer(model=model_args.model_name_or_path, reward_funcs=[exact_answer], args=training_args,
                          train_dataset=dataset[script_args.dataset_train_split],
                          peft_config=peft_config_of(model_args))
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    return trainer, model_args


def test_the_trl_command_line_pattern_trains_with_grpo_labs_parser(tmp_path, dataset_folder):
    "TrlParser((ScriptArguments, GRPOConfig, ModelConfig)) from grpo_lab parses LoRA options and trains to the end."
    from grpo_lab import GRPOConfig, ModelConfig, ScriptArguments, TrlParser, get_peft_config
    trainer, model_args = run_script(TrlParser, ScriptArguments, GRPOConfig, ModelConfig, get_peft_config,
                                     argv(tmp_path / "out", dataset_folder, "--use_peft", "true", "--lora_r", "4",
                                          "--lora_target_modules", "q_proj", "v_proj"))
    assert model_args.lora_r == 4 and trainer.state.global_step == 3
    adapter = trainer.accelerator.unwrap_model(trainer.model).peft_config["default"]
    assert adapter.r == 4 and set(adapter.target_modules) == {"q_proj", "v_proj"}


def test_the_half_changed_script_trains_with_trls_parser_and_model_config(tmp_path, dataset_folder):
    "The parser and ModelConfig still from trl, the config and trainer from grpo_lab: no option clashes."
    trl = pytest.importorskip("trl")
    from grpo_lab import GRPOConfig
    trainer, model_args = run_script(trl.TrlParser, trl.ScriptArguments, GRPOConfig, trl.ModelConfig,
                                     trl.get_peft_config,
                                     argv(tmp_path / "out", dataset_folder, "--use_peft", "--lora_r", "4"))
    assert isinstance(model_args, trl.ModelConfig) and trainer.state.global_step == 3
    assert trainer.accelerator.unwrap_model(trainer.model).peft_config["default"].r == 4


def test_model_init_kwargs_with_trust_remote_code_and_a_dtype(tmp_path, dataset_folder):
    "TRL's script always puts trust_remote_code in model_init_kwargs; with a dtype it loads and trains (full FT)."
    from grpo_lab import GRPOConfig, ModelConfig, ScriptArguments, TrlParser, get_peft_config
    trainer, _ = run_script(TrlParser, ScriptArguments, GRPOConfig, ModelConfig, get_peft_config,
                            argv(tmp_path / "out", dataset_folder, "--trust_remote_code", "true",
                                 "--model_init_kwargs", '{"trust_remote_code": false, "dtype": "float32"}'))
    assert trainer.args.model_init_kwargs["trust_remote_code"] is False
    assert trainer.accelerator.unwrap_model(trainer.model).dtype == torch.float32 and trainer.state.global_step == 3


def test_a_bf16_loaded_model_trains_with_bf16(tmp_path, dataset_folder):
    "`--dtype bfloat16 --bf16 true` (a recipe on a GPU) trains to the end on the CPU too, with finite losses."
    from grpo_lab import GRPOConfig, ModelConfig, ScriptArguments, TrlParser, get_peft_config
    trainer, _ = run_script(TrlParser, ScriptArguments, GRPOConfig, ModelConfig, get_peft_config,
                            argv(tmp_path / "out", dataset_folder, "--dtype", "bfloat16", "--bf16", "true",
                                 "--use_cpu", str(not torch.cuda.is_available())))
    assert trainer.state.global_step == 3 and all(math.isfinite(h["loss"]) for h in trainer.history)


def test_a_peft_model_passed_as_model_trains_its_adapter(tmp_path):
    "A PeftModel built by the script is trained as it is: only its adapter moves."
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from grpo_lab import GRPOConfig, GRPOTrainer
    from grpo_lab.data import arithmetic_task
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(TINY), LoraConfig(r=4, target_modules=["q_proj"]))
    before = {k: v.clone() for k, v in model.named_parameters()}
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_steps=2,
                      max_completion_length=5, learning_rate=1e-2, save_strategy="no", report_to="none",
                      gradient_checkpointing=False, disable_tqdm=True)
    trainer = GRPOTrainer(model, exact_answer, args=args, train_dataset=arithmetic_task(16),
                          processing_class=AutoTokenizer.from_pretrained(TINY))
    trainer.train()
    moved = {k for k, v in trainer.accelerator.unwrap_model(trainer.model).named_parameters()
             if not torch.equal(v, before[k])}
    assert moved and all("lora_" in k for k in moved)


def _parameters(fn) -> tuple[set, bool]:
    "The named parameters of a function and whether it takes **kwargs."
    import inspect
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}, \
        any(p.kind == p.VAR_KEYWORD for p in params)


def test_every_public_name_of_trls_trainer_exists_with_its_signature_or_is_refused():
    "Each public name of TRL 1.16's GRPOTrainer: present with TRL's parameter names (or **kwargs), or refused in words."
    import inspect
    trl = pytest.importorskip("trl")
    from grpo_lab import GRPOTrainer
    from grpo_lab.surface import REFUSED_METHODS
    theirs = [n for n in dir(trl.GRPOTrainer) if not n.startswith("_")]
    missing, mismatched = [], []
    for name in theirs:
        if not hasattr(GRPOTrainer, name):
            missing.append(name)
            continue
        if name in REFUSED_METHODS:
            with pytest.raises(NotImplementedError, match=f"GRPOTrainer.{name} is not supported"):
                getattr(GRPOTrainer, name)(object())
            continue
        trl_member, ours = getattr(trl.GRPOTrainer, name), getattr(GRPOTrainer, name)
        if callable(trl_member):
            wanted, _ = _parameters(trl_member)
            have, open_ended = _parameters(ours)
            wanted -= {"_internal_call", "trial", "ignore_keys_for_eval"}   # HF internals: accepted by **kwargs below
            if not (wanted <= have or open_ended):
                mismatched.append(f"{name}: TRL {sorted(wanted)}, grpo-lab {sorted(have)}")
        else:
            assert type(ours) is type(trl_member), name
    assert not missing and not mismatched, (missing, mismatched)


def test_the_calls_scripts_make_after_train(tmp_path, dataset_folder):
    "save_model, log_metrics, save_metrics, save_state, create_model_card, is_world_process_zero and end, as in TRL."
    from grpo_lab import GRPOConfig, ModelConfig, ScriptArguments, TrlParser, get_peft_config
    out = tmp_path / "out"
    trainer, _ = run_script(TrlParser, ScriptArguments, GRPOConfig, ModelConfig, get_peft_config,
                            argv(out, dataset_folder, "--max_steps", "2"))
    metrics = {"train_runtime": 1.0, "reward": 0.5}
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    trainer.save_model(str(out))
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    trainer.create_model_card(model_name="tiny-grpo", dataset_name="arith", tags=["math"])
    trainer.end()
    card = (out / "README.md").read_text()
    assert "- math" in card and "- trl" in card and "# tiny-grpo" in card and "arith" in card
    assert json.loads((out / "train_results.json").read_text())["reward"] == 0.5
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert (out / "model.safetensors").exists() and (out / "all_results.json").exists()
