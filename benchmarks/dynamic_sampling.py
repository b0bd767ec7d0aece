"""Issue 43's target for dynamic sampling, measured: the tiny demo with `dynamic_sampling` off and on, seed by seed.

The target: the same held-out accuracy in <= 0.8x the wall time, or a higher accuracy in the same time, over >= 5
seeds. Both arms are `benchmarks/ladder.py`'s runs (the demo recipe, `--steps` optimizer steps, held-out accuracy on
the demo's 500 unseen problems every `--eval-every` steps, the seconds of the training steps alone); they run
interleaved (off, on, off, on, ... seed by seed) so that a shared machine loads both alike, and each records its load
average. Each run also records its CPU seconds (`time.process_time`, one torch thread): on a loaded machine the wall
seconds carry the other jobs' share, the CPU seconds much less of it.

    nice -n 5 python benchmarks/dynamic_sampling.py --seeds 0 1 2 3 4 --steps 300 \
        --output benchmarks/results/dynamic-sampling-2026-11-27.jsonl
    python benchmarks/dynamic_sampling.py --summarize benchmarks/results/dynamic-sampling-2026-11-27.jsonl

"Time to the baseline's accuracy": for each seed, the training seconds the `on` run took to first reach, at one of its
held-out measurements, the accuracy the `off` run ended with (the `off` run took its total seconds, by construction);
the ratio of the two is the figure the target speaks of. A run that never reaches it counts as not reached. "At the
same time": the `on` run's accuracy at its last measurement within the `off` run's training seconds, against the
`off` run's final accuracy.
"""
import argparse
import statistics
from pathlib import Path

from ladder import read_runs, run_interleaved, summarize


def time_to_reach(run: dict, accuracy: float, cpu: bool = False) -> float | None:
    "Training seconds (wall, or CPU) at the first held-out measurement of `run` at or above `accuracy` (None: never)."
    return next((point[3 if cpu else 2] for point in run["accuracy_curve"] if point[1] >= accuracy), None)


def accuracy_within(run: dict, seconds: float, cpu: bool = False) -> float:
    "The held-out accuracy of `run` at its last measurement within `seconds` of training (wall, or CPU)."
    return [point[1] for point in run["accuracy_curve"] if point[3 if cpu else 2] <= seconds][-1]


def compare(runs: list[dict]) -> str:
    "Seed by seed: accuracies, seconds, their ratio, the time the `on` run took to reach the `off` run's final accuracy."
    off = {r["seed"]: r for r in runs if r["arm"] == "baseline"}
    on = {r["seed"]: r for r in runs if r["arm"] == "dynamic_sampling"}
    seeds = sorted(set(off) & set(on))
    lines = ["| seed | off: accuracy | on: accuracy | off: train s (CPU s) | on: train s (CPU s) | on / off: wall, CPU | "
             "on: s to off's final accuracy (CPU s) | that / off's: wall, CPU | mean rounds per step (on) | load avg (off, on) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios, cpu_ratios, reach, cpu_reach = [], [], [], []
    for s in seeds:
        a, b = off[s], on[s]
        t, c = time_to_reach(b, a["accuracy"]), time_to_reach(b, a["accuracy"], cpu=True)
        ratios.append(b["train_seconds"] / a["train_seconds"])
        cpu_ratios.append(b["train_cpu_seconds"] / a["train_cpu_seconds"])
        reach.append(None if t is None else t / a["train_seconds"])
        cpu_reach.append(None if c is None else c / a["train_cpu_seconds"])
        rounds = statistics.mean(r for _, r in b["rounds"]) if b["rounds"] else float("nan")
        lines.append(f"| {s} | {a['accuracy']:.1%} | {b['accuracy']:.1%} | {a['train_seconds']:.0f} ({a['train_cpu_seconds']:.0f}) | "
                     f"{b['train_seconds']:.0f} ({b['train_cpu_seconds']:.0f}) | {ratios[-1]:.2f}, {cpu_ratios[-1]:.2f} | "
                     f"{'not reached' if t is None else f'{t:.0f} ({c:.0f})'} | "
                     f"{'-' if t is None else f'{reach[-1]:.2f}, {cpu_reach[-1]:.2f}'} | {rounds:.2f} | "
                     f"{a['loadavg'][0]}, {b['loadavg'][0]} |")
    lift = [100 * (on[s]["accuracy"] - off[s]["accuracy"]) for s in seeds]
    same_time = [100 * (accuracy_within(on[s], off[s]["train_seconds"]) - off[s]["accuracy"]) for s in seeds]
    same_cpu = [100 * (accuracy_within(on[s], off[s]["train_cpu_seconds"], cpu=True) - off[s]["accuracy"]) for s in seeds]
    reached = [x for x in reach if x is not None]
    lines += ["", f"seeds {len(seeds)}; accuracy off {statistics.mean(100 * off[s]['accuracy'] for s in seeds):.1f}%, "
              f"on {statistics.mean(100 * on[s]['accuracy'] for s in seeds):.1f}%; lift {statistics.mean(lift):+.1f} points "
              f"(sd {statistics.stdev(lift) if len(lift) > 1 else 0:.1f}, {sum(x > 0 for x in lift)} of {len(lift)} seeds ahead); "
              f"wall-time ratio on/off {statistics.mean(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}), "
              f"CPU-time ratio {statistics.mean(cpu_ratios):.2f} (min {min(cpu_ratios):.2f}, max {max(cpu_ratios):.2f}); "
              f"off's final accuracy reached by 'on' in {len(reached)} of {len(seeds)} seeds"
              + (f", at {statistics.mean(reached):.2f}x off's wall seconds on average (min {min(reached):.2f}, max "
                 f"{max(reached):.2f}) and {statistics.mean(x for x in cpu_reach if x is not None):.2f}x its CPU seconds"
                 if reached else ""),
              "", f"at the same time: 'on' at its last measurement within off's training seconds minus off's final "
              f"accuracy, per seed: wall {', '.join(f'{x:+.1f}' for x in same_time)} (mean {statistics.mean(same_time):+.1f} "
              f"points); CPU {', '.join(f'{x:+.1f}' for x in same_cpu)} (mean {statistics.mean(same_cpu):+.1f} points)"]
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/dynamic-sampling-2026-11-27.jsonl"))
    p.add_argument("--summarize", type=Path, default=None, help="print the tables of a record and exit")
    a = p.parse_args()
    if not a.summarize:
        run_interleaved(["baseline", "dynamic_sampling"], a.seeds, a.steps, a.eval_every, a.output, a.threads)
    runs = read_runs(a.summarize or a.output)
    print(summarize(runs), "", compare(runs), sep="\n")
