"""Does ``raytpu launch`` slow a script down, and where does its start-up go? The example Accelerate
script under ``raytpu launch`` and under ``torchrun`` with the same processes, side by side, alternating.

Both run ``examples/accelerate/train.py`` on 2 CPU processes over gloo (torchrun with the
environment Accelerate needs for that, ``USE_TORCH_XLA=0 ACCELERATE_USE_CPU=true``); the script
measures its own throughput after its first log interval. Each command's wall time is measured
around it; ``raytpu launch``'s is split from its run's ``goodput.json`` (the driver's moments and
rank 0's script start and end): imports and checks, the Ray instance, the worker group, the
worker's set-up, the script, the run's end, Ray's shutdown, and the interpreter's exit. Last line:
``ratio=<raytpu launch / torchrun samples/s>``.

    python bench/launch_overhead.py [--rounds 3] [--samples 65536]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "accelerate" / "train.py")
BIN = Path(sys.executable).parent
#: raytpu launch's parts, between two moments of its goodput record
PARTS = [
    ("imports and checks", "started", "connect"),
    ("Ray instance", "connect", "connected"),
    ("planning", "connected", "fit"),
    ("worker group start", "fit", "entered"),
    ("worker set-up", "entered", "first_step"),
    ("the script", "first_step", "recorded"),
    ("run end", "recorded", "fitted"),
    ("Ray shutdown", "fitted", "ended"),
]


def run(command: list[str], env: dict[str, str]) -> tuple[str, float, float]:
    """(stdout, wall seconds of the whole command, when it started)."""
    began = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - began
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout, wall, began


def samples_per_s(text: str) -> float:
    return float(
        next(json.loads(line) for line in reversed(text.splitlines()) if line.startswith("{"))["samples_per_s"]
    )


def launch_split(run_dir: Path, began: float, wall: float) -> dict[str, float]:
    """Seconds per part of one ``raytpu launch`` (its record's moments; the exit measured around it)."""
    command = json.loads((run_dir / "goodput.json").read_text())["commands"][-1]
    attempt = command["attempts"][-1]
    moments = {**command.get("marks", {}), **attempt, "started": command["started"], "ended": command["ended"]}
    split = {name: moments[end] - moments[start] for name, start, end in PARTS}
    split["interpreter exit"] = began + wall - command["ended"]
    split["process start to the record's start"] = command["started"] - began  # ~0: psutil's create time
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=65536)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="raytpu-launch-bench-"))
    atexit.register(shutil.rmtree, work, True)  # the benchmark keeps only what it prints
    script = [EXAMPLE, "--epochs", "2", "--samples", str(args.samples), "--log-every", "32", "--ckpt-every", "100000"]
    base_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    base_env.pop("RAY_ADDRESS", None)
    torchrun_env = {**base_env, "USE_TORCH_XLA": "0", "ACCELERATE_USE_CPU": "true"}
    speeds: dict[str, list[float]] = {"torchrun": [], "raytpu launch": []}
    walls: dict[str, list[float]] = {"torchrun": [], "raytpu launch": []}
    splits: list[dict[str, float]] = []
    for round_ in range(args.rounds):
        out = work / f"round{round_}"
        torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2", *script, "--results-dir", str(out / "t")]
        text, wall, _ = run(torchrun, torchrun_env)
        speeds["torchrun"].append(samples_per_s(text))
        walls["torchrun"].append(wall)
        name = f"bench-{round_}"
        launch = [str(BIN / "raytpu"), "launch", "--num_processes", "2", "--storage-path", str(out), "--name", name]
        text, wall, began = run([*launch, *script, "--results-dir", str(out / "r")], base_env)
        speeds["raytpu launch"].append(samples_per_s((out / name / "logs" / "rank_0.log").read_text()))
        walls["raytpu launch"].append(wall)
        splits.append(launch_split(out / name, began, wall))
        for label in speeds:
            print(
                f"round {round_} {label}: {speeds[label][-1]:.0f} samples/s, {walls[label][-1]:.1f} s wall", flush=True
            )
    medians = {label: statistics.median(values) for label, values in speeds.items()}
    for label in speeds:
        print(f"{label}: median {medians[label]:.0f} samples/s, whole command {statistics.median(walls[label]):.1f} s")
    print("raytpu launch, where the whole command's time went (median of the rounds):")
    for part in splits[0]:
        print(f"  {part:>36}: {statistics.median(split[part] for split in splits):6.2f} s")
    script_s = statistics.median(split["the script"] for split in splits)
    outside = statistics.median(walls["torchrun"]) - script_s
    print(f"  torchrun's whole command less raytpu's script time (its own start-up and end, roughly): {outside:.1f} s")
    print(f"ratio={medians['raytpu launch'] / medians['torchrun']:.3f}")


if __name__ == "__main__":
    main()
