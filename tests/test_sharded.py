"""Sharded training that runs: FSDP on 2 CPU processes (gloo) through grpo-lab's own trainer, against DDP.

How it shards: accelerate's own FSDP2 preparation (`Accelerator.prepare` -> `fsdp2_prepare_model`, the code a GPU
run goes through), reached on CPU processes by `grpo_lab.sharded.make_accelerator`: launched with accelerate's FSDP
config (`grpo-lab export --strategy fsdp --cpu`), it switches accelerate's distributed type from MULTI_CPU to FSDP
once accelerate has set up the gloo process group (accelerate 1.15 picks FSDP only on accelerators). The same script
runs under the exported DDP config for the comparison.
"""
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import ROOT, bin_path
from grpo_lab.scale import export_run
from test_scale import free_port, launch_env

TINY = ROOT / "configs" / "tiny-cpu.yaml"

# Train 3 steps (a checkpoint at step 2), save the model; resume a second trainer from checkpoint-2 to step 3; on the
# main process load the saved model with from_pretrained and compare its greedy answers with the trained policy's.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM
    from grpo_lab.data import arithmetic_task
    from grpo_lab.models import tiny_model_path
    from grpo_lab.rewards import exact_answer
    from grpo_lab.sharded import full_state_dict, gathered_for_generation, held_bytes, is_sharded
    from grpo_lab.trainer import GRPOConfig, GRPOTrainer

    out, gather = sys.argv[1], sys.argv[2] == "gather"

    def config(folder, **kw):
        return GRPOConfig(output_dir=f"{out}/{folder}", per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          num_generations=8, max_steps=3, beta=0.04, learning_rate=1e-3, max_prompt_length=32,
                          max_completion_length=6, lr_scheduler_type="constant", logging_steps=1, save_steps=2,
                          disable_tqdm=True, ds3_gather_for_generation=gather, **kw)

    def weights(trainer):
        sd = full_state_dict(trainer)
        if sd is None:
            sd = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        return {k: v.detach().cpu().clone() for k, v in sd.items()}

    data = arithmetic_task(64, seed=3)
    trainer = GRPOTrainer(str(tiny_model_path()), exact_answer, args=config("run"), train_dataset=data)
    held = held_bytes(trainer)            # before training: parameters only (Adam's states appear at the first step)
    trainer.train()
    held_after = held_bytes(trainer)
    final = weights(trainer)
    trainer.save_model(f"{out}/model")
    acc = trainer.accelerator
    prompts = [trainer.processing_class(p, return_tensors="pt").input_ids for p in ("3+4=", "99+99=", "12+9=")]
    with gathered_for_generation(trainer) as policy:          # every process answers (FSDP: gathered weights)
        policy.eval()
        trained = [policy.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist() for ids in prompts]
    # ds3_gather_for_generation=False: generate from the shards; each process asks in another order, so their answers
    # end at different steps and generate must keep them in step
    trainer.args.ds3_gather_for_generation = False
    mine = list(range(acc.process_index, 3)) + list(range(acc.process_index))
    with gathered_for_generation(trainer) as policy:
        from_shards = [policy.generate(prompts[i], max_new_tokens=6, do_sample=False)[0].tolist() for i in mine]
    trainer.args.ds3_gather_for_generation = gather

    resumed = GRPOTrainer(str(tiny_model_path()), exact_answer, args=config("run"), train_dataset=data)
    resumed.train(resume_from_checkpoint=f"{out}/run/checkpoint-2")
    again = weights(resumed)
    result = {"trained": trained, "world": acc.num_processes, "sharded": is_sharded(acc), "held_start": held, "held": held_after,
              "losses": [h["loss"] for h in trainer.history], "resumed_losses": [h["loss"] for h in resumed.history],
              "from_shards_equal": from_shards == [trained[i] for i in mine],
              "answer_lengths": [len(a) - ids.size(1) for a, ids in zip(trained, prompts)]}
    if acc.is_main_process:
        loaded = AutoModelForCausalLM.from_pretrained(f"{out}/model").eval()
        result["saved"] = [loaded.generate(ids, max_new_tokens=6, do_sample=False)[0].tolist() for ids in prompts]
        result["resume_max_diff"] = max((final[k] - again[k]).abs().max().item() for k in final)
        torch.save(final, f"{out}/weights.pt")
    json.dump(result, open(f"{out}/rank{acc.process_index}.json", "w"))
""")


def run(tmp_path, strategy: str, gather: bool = True) -> tuple[list[dict], float]:
    "The script on 2 CPU processes under the exported `strategy` config; each rank's result and the wall time."
    folder = tmp_path / f"{strategy}-{'gather' if gather else 'sharded'}"
    export = export_run(TINY, folder / "export", num_processes=2, strategy=strategy, cpu=True)
    (folder / "run.py").write_text(SCRIPT)
    t0 = time.perf_counter()
    r = subprocess.run([bin_path("accelerate"), "launch", "--config_file", str(export / "accelerate_config.yaml"),
                        "--main_process_port", str(free_port()), str(folder / "run.py"), str(folder),
                        "gather" if gather else "sharded"],
                       env=launch_env(ACCELERATE_USE_CPU="true"), capture_output=True, text=True, timeout=400)
    seconds = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((folder / f"rank{i}.json").read_text()) for i in (0, 1)], seconds


def relative(a: dict, b: dict, keys=None) -> float:
    "The relative difference ||a - b|| / ||b|| of two state dicts as one vector (over `keys`, default all)."
    keys = list(b) if keys is None else keys
    return (torch.cat([(a[k] - b[k]).flatten() for k in keys]).norm() / torch.cat([b[k].flatten() for k in keys]).norm()).item()


def test_fsdp_on_two_cpu_processes_equals_ddp_saves_resumes_and_halves_memory(tmp_path):
    (ddp, fsdp), (t_ddp, t_fsdp) = zip(*(run(tmp_path, s) for s in ("ddp", "fsdp")))
    assert [r["sharded"] for r in ddp + fsdp] == [False, False, True, True] and fsdp[0]["world"] == 2
    # 3 steps equal DDP's: the losses and the weights within 1e-5 relative
    assert len(fsdp[0]["losses"]) == 3       # (each process logs its own micro-batches' loss)
    loss_diff = max(abs(a - b) / max(abs(b), 1e-3) for a, b in zip(fsdp[0]["losses"], ddp[0]["losses"]))
    assert loss_diff <= 1e-5, (fsdp[0]["losses"], ddp[0]["losses"])
    w_fsdp, w_ddp = (torch.load(tmp_path / f"{s}-gather" / "weights.pt") for s in ("fsdp", "ddp"))
    weight_diff = relative(w_fsdp, w_ddp)
    assert set(w_fsdp) == set(w_ddp) and weight_diff <= 1e-5
    # tensor by tensor too, but for the keys' biases: softmax ignores a shift shared by all keys, so their gradient is
    # zero up to rounding, and Adam turns that noise (different sums in all-reduce and reduce-scatter) into lr-sized
    # steps (measured: up to 1e-4 relative, when every other tensor is within 1e-6)
    worst = max(relative(w_fsdp, w_ddp, [k]) for k in w_ddp if not k.endswith("k_proj.bias"))
    assert worst <= 1e-5, worst
    # a checkpoint (gathered whole, as DDP's) resumes to identical weights
    assert fsdp[0]["resume_max_diff"] == 0.0 and ddp[0]["resume_max_diff"] == 0.0
    # the saved model loads with from_pretrained and answers greedily as the trained policy does
    assert fsdp[0]["saved"] == fsdp[0]["trained"] == fsdp[1]["trained"]
    # and from the shards (ds3_gather_for_generation=False), with the processes' answers ending at different steps
    assert all(r["from_shards_equal"] for r in fsdp + ddp)
    assert len(set(fsdp[0]["answer_lengths"])) > 1        # (the answers end at different steps)
    # each process holds about half of DDP's parameters and Adam states
    ratio = [f["held"]["total"] / d["held"]["total"] for f, d in zip(fsdp, ddp)]
    assert all(r <= 0.6 for r in ratio), ratio
    assert ddp[0]["held"]["optimizer"] == 2 * ddp[0]["held"]["parameters"]      # Adam: two states per weight
    print(f"FSDP vs DDP, 3 steps on 2 CPU processes: loss diff {loss_diff:.1e}, weight diff {weight_diff:.1e} "
          f"(worst tensor {worst:.1e}); "
          f"held per process {fsdp[0]['held']['total']:,} / {fsdp[1]['held']['total']:,} vs {ddp[0]['held']['total']:,} "
          f"bytes (ratio {max(ratio):.3f}); runs {t_ddp:.0f} s (DDP), {t_fsdp:.0f} s (FSDP)")
