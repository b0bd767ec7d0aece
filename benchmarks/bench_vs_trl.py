"""grpo-lab vs TRL on the shipped tiny model with the README's settings: a thin wrapper over `grpo-lab bench`.

    python benchmarks/bench_vs_trl.py --steps 30
    # = grpo-lab bench --shape tiny --pd 64 -G 8 --completion-length 6 --learning-rate 5e-5 --threads 2 --steps 30

Any other `grpo-lab bench` option may follow and overrides these (`grpo-lab bench --help`); the benchmark itself
lives in grpo_lab/bench.py (taught in nbs/10_bench.ipynb) and its figures in BENCHMARKS.md.
"""
import sys

from grpo_lab.bench import main

README_SETTINGS = ["--shape", "tiny", "--pd", "64", "-G", "8", "--completion-length", "6", "--learning-rate", "5e-5",
                   "--loss-type", "dapo", "--threads", "2", "--repeats", "1", "--output-dir", "runs/bench-tiny"]

if __name__ == "__main__":
    sys.exit(main(README_SETTINGS + sys.argv[1:]))
