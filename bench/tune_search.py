"""Random search, Optuna's TPE and population-based training for the same trial budget, over seeds.

Each sweep is ``raytpu tune`` as a user runs it, on the toy regression job (``tests/toy_job.py``:
64 samples, SGD): the learning rate in ``loguniform(1e-4, 1)`` and the momentum in ``uniform(0,
0.95)``, 6 trials of 4 epochs, 2 at a time, ranked by ``valid/mse``; the same budget for each:

* **random**: ``--search-alg random --scheduler fifo``;
* **tpe**: ``--search-alg optuna --scheduler fifo`` (2 random trials, then TPE);
* **pbt**: ``--scheduler pbt --perturbation-interval 1`` (the 6 trials are the population; the
  lagging quarter goes on from a leader's checkpoint with a perturbed lr every report).

For each seed (``run.seed``, which seeds the trials and the searcher) it prints the best
``valid/mse`` each method reached; then, per method, the median over the seeds, and the last line
``ratio=<tpe median / random median>`` (below 1: TPE found a better config for the same budget).
A few minutes per seed on 2 cores; it starts a local Ray instance per sweep:

    python bench/tune_search.py [SEEDS]        # default 3
"""

from __future__ import annotations

import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "random": ["--search-alg", "random", "--scheduler", "fifo"],
    "tpe": ["--search-alg", "optuna", "--scheduler", "fifo"],
    "pbt": ["--scheduler", "pbt", "--perturbation-interval", "1"],
}
SEARCH = ["--search", "optim.lr=loguniform(1e-4, 1.0)", "--search", "optim.momentum=uniform(0, 0.95)"]
JOB = ["optim.name=sgd", "loop.epochs=4", "data.global_batch_size=8"]
JOB += ["scaling.num_workers=1", "scaling.cpus_per_worker=0.5", "logging.progress_bar=false"]


def best_mse(method: str, seed: int, out: Path) -> float:
    """The best ``valid/mse`` of one sweep (its ``results.csv``)."""
    name = f"{method}-{seed}"
    config = out / "toy.yaml"
    config.write_text("job: {name: tests.toy_job}\n")
    command = [sys.executable, "-m", "raytpu.cli", "tune", str(config), *JOB, f"run.seed={seed}"]
    command += [f"run.storage_path={out}"]
    command += [f"data.path={out}", *SEARCH, *METHODS[method], "--samples", "6", "--max-concurrent", "2"]
    command += ["--metric", "valid/mse", "--mode", "min", "--name", name]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        sys.exit(f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with (out / name / "results.csv").open() as handle:
        return min(float(row["valid/mse"]) for row in csv.DictReader(handle) if row["valid/mse"])


def main() -> None:
    seeds = range(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
    out = Path(tempfile.mkdtemp(prefix="rtts-", dir="/tmp"))
    found: dict[str, list[float]] = {method: [] for method in METHODS}
    for seed in seeds:
        for method in METHODS:
            found[method].append(best_mse(method, seed, out))
        print(f"seed {seed}: " + "  ".join(f"{method} {found[method][-1]:.4f}" for method in METHODS), flush=True)
    medians = {method: statistics.median(values) for method, values in found.items()}
    for method, values in found.items():
        print(f"{method:6s} median best valid/mse {medians[method]:.4f} over {len(values)} seeds ({values})")
    print(f"ratio={medians['tpe'] / medians['random']:.3f}")


if __name__ == "__main__":
    main()
