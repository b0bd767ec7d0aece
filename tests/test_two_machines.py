"""The two-machine rehearsal: `grpo-lab export --num-machines 2` and its `launch.sh` run twice on this machine, as a new
user would run it on two (MACHINE_RANK 0 and 1, MAIN_PROCESS_IP=127.0.0.1; DDP on CPU processes, one per "machine").

The two "machines" share this disk, as two real ones must share output_dir for checkpoints (each process writes its
own file into the checkpoint folder the main process made). One "machine" is killed mid-run; both are launched again
with --resume and reach the weights of a run that was never interrupted."""
import json
import subprocess
import time

import psutil
from safetensors.torch import load_file

from conftest import ROOT
from grpo_lab.scale import export_run
from test_scale import launch_env

TINY = ROOT / "configs" / "tiny-cpu.yaml"
ARGS = ["--max_steps", "24", "--save_steps", "2", "--logging_steps", "1", "--per_device_train_batch_size", "16",
        "--disable_tqdm", "true"]


def launch(script, out, env, *extra, rank=None):
    "Start `bash launch.sh` (arguments: ARGS, the output folder, `extra`), its output to a log file."
    env = env if rank is None else {**env, "MACHINE_RANK": str(rank), "MAIN_PROCESS_IP": "127.0.0.1"}
    log = open(out.parent / f"{out.name}-rank{rank}.log", "a")
    return subprocess.Popen(["bash", str(script), *ARGS, "--output_dir", str(out), *extra], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def kill_machine(proc: subprocess.Popen):
    "What a machine's death does: every process of its launch dies at once (torchrun starts its workers in sessions of their own)."
    launcher = psutil.Process(proc.pid)
    for p in [launcher, *launcher.children(recursive=True)]:
        p.kill()


def losses(out) -> list[float]:
    return [h["loss"] for h in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in h]


def wait(procs, timeout=300) -> list[int]:
    return [p.wait(timeout=timeout) for p in procs]


def test_two_machines_train_like_one_and_resume_after_one_is_killed(tmp_path):
    t0 = time.perf_counter()
    one = export_run(TINY, tmp_path / "one", num_processes=2, cpu=True)
    two = export_run(TINY, tmp_path / "two", num_processes=2, num_machines=2, cpu=True)
    # beside each other: one machine with 2 processes (the reference run) and two "machines" with one process each,
    # of which machine 1 is killed once checkpoint-2 is written; then both "machines" resume
    reference = launch(one / "launch.sh", tmp_path / "run-one", launch_env())
    env, out = launch_env(), tmp_path / "run-two"
    machines = [launch(two / "launch.sh", out, env, rank=r) for r in (0, 1)]
    while not (out / "checkpoint-2").is_dir() and all(p.poll() is None for p in machines):
        time.sleep(0.05)
    kill_machine(machines[1])
    assert machines[1].wait(timeout=60) != 0
    try:                                         # machine 0 loses its peer: it fails, or it is stopped here
        code = machines[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_machine(machines[0])
        code = machines[0].wait(timeout=60)
    assert code != 0 and not (out / "checkpoint-24").exists()          # killed mid-run
    env = launch_env()                           # a fresh port: the killed run's may still be held
    resumed = [launch(two / "launch.sh", out, env, "--resume", rank=r) for r in (0, 1)]
    assert wait(resumed) == [0, 0], (out.parent / "run-two-rank0.log").read_text()[-3000:]
    assert wait([reference]) == [0]
    # the interrupted two-machine run logs the one-machine run's losses and ends with its weights, bit for bit
    assert losses(out) == losses(tmp_path / "run-one") and len(losses(out)) == 24
    final_two, final_one = (load_file(d / "model.safetensors") for d in (out, tmp_path / "run-one"))
    assert set(final_two) == set(final_one) and all((final_two[k] == final_one[k]).all() for k in final_one)
    print(f"two-machine rehearsal (one run, a killed and resumed two-machine run): {time.perf_counter() - t0:.0f} s")
