"""Scale-out: exported accelerate configs as accelerate reads them, and a real 2-process run on CPU."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file

from conftest import ROOT, bin_path
from grpo_lab.batching import BatchConfigError, plan_batches
from grpo_lab.scale import STRATEGIES, export_run, same_effective_batch

TINY = ROOT / "configs" / "tiny-cpu.yaml"
COLAB = ROOT / "configs" / "colab-t4-qwen-gsm8k.yaml"

# What `accelerate launch` does with a config before it starts any process: its own argument checks,
# the environment it hands to the processes, and the DeepSpeed / FSDP plugin each process builds from it.
LAUNCH_CHECK = textwrap.dedent("""
    import json, os, sys
    from accelerate.commands.launch import launch_command_parser, _validate_launch_command
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
    args, defaults, mp_from_config = _validate_launch_command(launch_command_parser().parse_args(sys.argv[1:]))
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    os.environ.update(env)
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    out = {"deepspeed": args.use_deepspeed, "fsdp": args.use_fsdp, "multi_gpu": args.multi_gpu}
    if args.use_deepspeed:
        plugin = DeepSpeedPlugin()
        out |= {"zero_stage": plugin.zero_stage, "zero3_init": plugin.zero3_init_flag,
                "micro_batch": plugin.deepspeed_config["train_micro_batch_size_per_gpu"]}
    if args.use_fsdp:
        plugin = FullyShardedDataParallelPlugin()
        out |= {"fsdp_version": plugin.fsdp_version, "wrap": plugin.transformer_cls_names_to_wrap}
    print(json.dumps(out))
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra) -> dict:
    "The environment of a launch: the venv's accelerate and grpo-lab first on PATH, one thread per process."
    return {**os.environ, "PATH": f"{bin_path('')}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "MAIN_PROCESS_PORT": str(free_port()), "HF_HUB_OFFLINE": "1", **extra}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_gives_a_config_that_accelerate_launch_accepts(tmp_path, strategy):
    out = export_run(TINY, tmp_path, num_processes=4, strategy=strategy, allow_untested=True)    # zero2/3: untested
    config = load_config_from_file(str(out / "accelerate_config.yaml"))
    assert config.num_processes == 4 and not config.use_cpu
    launch_args = ["--config_file", str(out / "accelerate_config.yaml")]
    if strategy.startswith("zero"):
        launch_args += ["--deepspeed_config_file", str(out / "ds_config.json")]
        assert '--deepspeed_config_file "$HERE/ds_config.json"' in (out / "launch.sh").read_text()
    r = subprocess.run([sys.executable, "-c", LAUNCH_CHECK, *launch_args, "train.py"], capture_output=True, text=True,
                       env=launch_env(), timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    expected = {"ddp": {"multi_gpu": True},
                "zero2": {"deepspeed": True, "zero_stage": 2, "zero3_init": False, "micro_batch": 128},
                "zero3": {"deepspeed": True, "zero_stage": 3, "zero3_init": True, "micro_batch": 128},
                "fsdp": {"fsdp": True, "fsdp_version": 2, "wrap": ["Qwen2DecoderLayer"]}}[strategy]
    assert {k: seen[k] for k in expected} == expected


def test_the_exported_run_is_the_same_run_with_gpu_precision(tmp_path):
    out = export_run(COLAB, tmp_path, num_processes=4)
    source, exported = yaml.safe_load(COLAB.read_text()), yaml.safe_load((out / "run.yaml").read_text())
    assert {k: v for k, v in exported.items() if k not in ("bf16", "fp16")} == {k: v for k, v in source.items() if k != "fp16"}
    assert exported["bf16"] and not exported["fp16"]
    readme = (out / "README.md").read_text()
    assert "| `prompts_per_optimizer_step` | 4 | 16 |" in readme and "--gradient_accumulation_steps 1" in readme


def test_seven_gpus_with_groups_of_eight_raise_with_suggestions(tmp_path):
    run = {**yaml.safe_load(TINY.read_text()), "per_device_train_batch_size": 1}
    with pytest.raises(BatchConfigError, match="divisible by num_generations 8") as e:
        export_run(run, tmp_path / "seven", num_processes=7)
    assert {"num_processes": 8} in e.value.suggestions and {"num_generations": 7} in e.value.suggestions
    assert not (tmp_path / "seven").exists()


@pytest.mark.parametrize("kwargs, words", [
    (dict(strategy="zero1"), "'ddp'"),
    (dict(strategy="zero3", cpu=True, allow_untested=True), "only on GPUs"),
    (dict(strategy="zero2"), "not been shown to train.*allow_untested=True"),
    (dict(num_processes=0), "num_processes=0"),
    (dict(num_processes=6, num_machines=4), "multiple of num_machines"),
    (dict(mixed_precision="fp8"), "mixed_precision='fp8'"),
])
def test_bad_exports_say_what_is_wrong(tmp_path, kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        export_run(TINY, tmp_path, **{"num_processes": 2, **kwargs})


@pytest.mark.parametrize("strategy", ["zero3", "fsdp"])
def test_qlora_is_refused_with_sharded_weights_and_allowed_otherwise(tmp_path, strategy):
    with pytest.raises(ValueError, match="load_in_4bit=True.*strategy='ddp'"):
        export_run(COLAB, tmp_path / strategy, num_processes=8, strategy=strategy)
    for ok in ("ddp", "zero2"):
        assert (export_run(COLAB, tmp_path / ok, num_processes=8, strategy=ok, allow_untested=True) / "launch.sh").exists()


def test_lora_with_fsdp_is_refused_in_the_export_and_allowed_with_ddp(tmp_path):
    "A LoRA adapter under FSDP has not been shown to train (accelerate's FSDP2 preparation stops on a PEFT model)."
    run = tmp_path / "lora.yaml"
    run.write_text(TINY.read_text() + "lora_r: 8\n")
    with pytest.raises(ValueError, match="lora_r=8 with strategy='fsdp'.*strategy='ddp'"):
        export_run(run, tmp_path / "fsdp", num_processes=2, strategy="fsdp")
    assert (export_run(run, tmp_path / "ddp", num_processes=2, strategy="ddp") / "launch.sh").exists()


@pytest.mark.parametrize("options, move, changes, exact", [
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8), (1, 4),
     {"gradient_accumulation_steps": 1}, True),
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8), (1, 8),
     {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1}, True),
    (dict(per_device_train_batch_size=128, gradient_accumulation_steps=1, num_generations=8), (1, 2),
     {"per_device_train_batch_size": 64}, True),
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8), (4, 1),
     {"gradient_accumulation_steps": 4}, True),
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, num_generations=8), (1, 3),
     {"gradient_accumulation_steps": 1}, False),
])
def test_same_effective_batch(options, move, changes, exact):
    s = same_effective_batch(options, *move)
    assert s["changes"] == changes and s["exact"] is exact
    before = plan_batches(**options, num_processes=move[0])
    after = plan_batches(**{**options, **changes}, num_processes=move[1])
    assert (after.completions_per_optimizer_step == before.completions_per_optimizer_step) is exact
    assert s["prompts_per_optimizer_step"] == (before.prompts_per_optimizer_step, after.prompts_per_optimizer_step)
    assert ("nearest" in s["note"]) is not exact


def test_the_exported_launch_script_trains_on_two_cpu_processes(tmp_path):
    out = export_run(TINY, tmp_path / "export", num_processes=2, cpu=True)
    run_dir = tmp_path / "run"
    t0 = time.perf_counter()
    r = subprocess.run(["bash", str(out / "launch.sh"), "--max_steps", "3", "--logging_steps", "1",
                        "--output_dir", str(run_dir), "--disable_tqdm"], cwd=tmp_path, env=launch_env(), capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    *logged, summary = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in logged] == [1, 2, 3] and "train_loss" in summary   # then the run's summary line
    assert (run_dir / "model.safetensors").exists()
    # Two processes ran: each prints the final line, and the epoch advanced as the 2-process plan says
    # (32 prompts per generation batch, 125 per epoch, against 16 and 250 on one process).
    assert r.stdout.count("final policy:") == 2, r.stdout
    two, one = (plan_batches(128, 1, n, 8, dataset_size=4000).generations_per_epoch for n in (2, 1))
    assert (two, one) == (125, 250)
    assert logged[2]["epoch"] == pytest.approx(3 / two)      # after step 3, three generation batches are done
    print(f"2-process tiny-cpu run, 3 steps: {seconds:.1f} s")


WEIGHTS_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from transformers import TrainerCallback
    from grpo_lab.data import arithmetic_task
    from grpo_lab.models import tiny_model_path
    from grpo_lab.rewards import exact_answer
    from grpo_lab.trainer import GRPOConfig, GRPOTrainer

    def weights_hash(trainer):
        model = trainer.accelerator.unwrap_model(trainer.model)
        return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()

    counts = {"allreduce_rounds": 0, "optimizer_steps": 0}

    def counting_allreduce(state, bucket):
        "DDP's own all-reduce, counting one round per backward that synchronises (bucket 0 opens a round)."
        counts["allreduce_rounds"] += bucket.index() == 0
        return allreduce_hook(state, bucket)

    class KeepCompletions(TrainerCallback):
        completions = []
        def on_log(self, args, state, control, logs=None, completions=None, **kwargs):
            KeepCompletions.completions = completions or KeepCompletions.completions

    out = sys.argv[1]
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=8,
                      max_steps=3, beta=0.04, learning_rate=1e-3, max_prompt_length=32, max_completion_length=6,
                      lr_scheduler_type="constant", logging_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(str(tiny_model_path()), exact_answer, args=args, train_dataset=arithmetic_task(64, seed=3))
    trainer.model.register_comm_hook(None, counting_allreduce)
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: (counts.__setitem__("optimizer_steps", counts["optimizer_steps"] + 1), step(*a, **k))[1]
    before = weights_hash(trainer)
    trainer.train()
    acc = trainer.accelerator
    # a group straddling both processes, and an epoch ending inside an accumulation
    edge = GRPOConfig(output_dir=out + "/edge", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      steps_per_generation=3, num_generations=8, num_train_epochs=2, learning_rate=1e-3,
                      max_prompt_length=32, max_completion_length=6, disable_tqdm=True, gradient_checkpointing=False,
                      save_strategy="no", logging_steps=1)   # HF logs the last step only on a logging step
    trainer2 = GRPOTrainer(str(tiny_model_path()), exact_answer, args=edge, train_dataset=arithmetic_task(3, seed=5),
                           callbacks=[KeepCompletions()])
    trainer2.train()
    json.dump({"world": acc.num_processes, "before": before, "after": weights_hash(trainer), **counts,
               "steps": trainer.state.global_step, "micro_steps": trainer.plan.steps_per_generation * 3,
               "unique_prompts": trainer.plan.unique_prompts_per_generation, "edge_steps": trainer2.state.global_step,
               "edge_after": weights_hash(trainer2), "edge_samples": KeepCompletions.completions},
              open(f"{out}/rank{acc.process_index}.json", "w"))
""")


def run_two_cpu_processes(tmp_path, script: str, config=TINY) -> list[dict]:
    "Run `script` (it gets tmp_path as its argument and writes rank<i>.json) on 2 CPU processes with the export of `config`; the two JSONs."
    out = export_run(config, tmp_path / "export", num_processes=2, cpu=True)
    (tmp_path / "run.py").write_text(script)
    r = subprocess.run([bin_path("accelerate"), "launch", "--config_file", str(out / "accelerate_config.yaml"),
                        "--main_process_port", str(free_port()), str(tmp_path / "run.py"), str(tmp_path)],
                       env=launch_env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]


def test_both_processes_end_with_identical_weights(tmp_path):
    "Gradients are averaged over processes before every step, so the two replicas never drift apart."
    ranks = run_two_cpu_processes(tmp_path, WEIGHTS_SCRIPT)
    assert [x["world"] for x in ranks] == [2, 2]
    assert ranks[0]["unique_prompts"] == 2          # 4 completions x 2 processes x 2 accumulation steps / 8
    assert ranks[0]["before"] == ranks[1]["before"] and ranks[0]["after"] != ranks[0]["before"]
    assert ranks[0]["after"] == ranks[1]["after"]
    # gradient accumulation under Accelerate: 6 micro-steps, but one all-reduce and one optimizer step per step
    assert [(x["allreduce_rounds"], x["optimizer_steps"]) for x in ranks] == [(3, 3), (3, 3)]
    assert ranks[0]["micro_steps"] == 6
    # partial accumulation at each epoch's end still synchronises gradients
    assert ranks[0]["edge_steps"] == 4 and ranks[0]["edge_after"] == ranks[1]["edge_after"]
    # the prompt shared by both processes gets different completions on each (per-process sampling seeds)
    shared = lambda r: [s["completion"] for s in r["edge_samples"] if s["prompt"] == ranks[0]["edge_samples"][-1]["prompt"]]
    assert ranks[0]["edge_samples"][-1]["prompt"] == ranks[1]["edge_samples"][0]["prompt"]
    assert shared(ranks[0]) != shared(ranks[1])


def test_export_refuses_to_overwrite_and_to_write_into_a_file(tmp_path):
    (tmp_path / "launch.sh").write_text("echo mine")
    with pytest.raises(ValueError, match="already holds launch.sh: export would overwrite"):
        export_run(TINY, tmp_path, num_processes=2)
    assert (tmp_path / "launch.sh").read_text() == "echo mine" and not (tmp_path / "run.yaml").exists()
    with pytest.raises(ValueError, match="is a file"):
        export_run(TINY, tmp_path / "launch.sh", num_processes=2)
    assert (export_run(TINY, tmp_path, num_processes=2, overwrite=True) / "run.yaml").exists()


def test_the_run_yaml_is_read_once(tmp_path, monkeypatch):
    import grpo_lab.scale as scale
    reads = []
    monkeypatch.setattr(scale, "load_run_file", lambda path, real=scale.load_run_file: reads.append(path) or real(path))
    export_run(TINY, tmp_path, num_processes=2)
    assert reads == [TINY]


def test_options_convert_as_trl_does_and_bad_values_are_named(tmp_path):
    from grpo_lab.scale import read_run
    cfg = tmp_path / "run.yaml"
    cfg.write_text(TINY.read_text() + "warmup_steps: 1e-1\n")
    run = read_run(cfg, {"learning_rate": "1e-5", "max_steps": "7", "bf16": "false"})
    assert (run["warmup_steps"], run["learning_rate"], run["max_steps"], run["bf16"]) == (0.1, 1e-5, 7, False)
    with pytest.raises(ValueError, match="on the command line is not a whole number") as e:
        read_run(cfg, {"max_steps": "x" * 10**6})
    assert str(e.value).startswith("max_steps='xxx") and len(str(e.value)) < 300
