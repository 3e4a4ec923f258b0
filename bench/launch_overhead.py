"""Does ``raytpu launch`` slow a script down? The example Accelerate script's steady-state samples/s
under ``raytpu launch`` against ``torchrun`` with the same processes, side by side, alternating.

Both run ``examples/accelerate/train.py`` on 2 CPU processes over gloo (torchrun with the
environment Accelerate needs for that, ``USE_TORCH_XLA=0 ACCELERATE_USE_CPU=true``); the script
measures its own throughput after its first log interval. Whole-command wall times (start-up
included) are printed separately. Last line: ``ratio=<raytpu launch / torchrun samples/s>``.

    python bench/launch_overhead.py [--rounds 3] [--samples 65536]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "accelerate" / "train.py")
BIN = Path(sys.executable).parent


def throughput(command: list[str], env: dict[str, str], summary_file: Path | None) -> tuple[float, float]:
    """(samples/s the script measured, wall seconds of the whole command)."""
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    text = summary_file.read_text() if summary_file else done.stdout
    summary = next(json.loads(line) for line in reversed(text.splitlines()) if line.startswith("{"))
    return float(summary["samples_per_s"]), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=65536)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="raytpu-launch-bench-"))
    script = [EXAMPLE, "--epochs", "2", "--samples", str(args.samples), "--log-every", "32", "--ckpt-every", "100000"]
    base_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    torchrun_env = {**base_env, "USE_TORCH_XLA": "0", "ACCELERATE_USE_CPU": "true"}
    results: dict[str, list[tuple[float, float]]] = {"torchrun": [], "raytpu launch": []}
    for round_ in range(args.rounds):
        out = work / f"round{round_}"
        torchrun = [str(BIN / "torchrun"), "--nproc_per_node", "2", *script, "--results-dir", str(out / "t")]
        results["torchrun"].append(throughput(torchrun, torchrun_env, None))
        name = f"bench-{round_}"
        launch = [str(BIN / "raytpu"), "launch", "--num_processes", "2", "--storage-path", str(out), "--name", name]
        launch += [*script, "--results-dir", str(out / "r")]
        results["raytpu launch"].append(throughput(launch, base_env, out / name / "logs" / "rank_0.log"))
        for label, runs in results.items():
            print(f"round {round_} {label}: {runs[-1][0]:.0f} samples/s, {runs[-1][1]:.1f} s wall", flush=True)
    medians = {label: statistics.median(r[0] for r in runs) for label, runs in results.items()}
    walls = {label: statistics.median(r[1] for r in runs) for label, runs in results.items()}
    for label in results:
        print(f"{label}: median {medians[label]:.0f} samples/s, whole command {walls[label]:.1f} s (start-up included)")
    print(f"ratio={medians['raytpu launch'] / medians['torchrun']:.3f}")


if __name__ == "__main__":
    main()
