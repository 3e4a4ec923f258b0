"""Start-up cost of a one-step run of MSHNet small on 2 CPU processes, three ways, side by side.

Whole-process wall time (median of ``--repeats``, the three commands alternating), on a data set
made beforehand:

* ``torchrun``: ``torchrun --nproc_per_node 2 bench/bare_step.py`` (torch, the job's model and
  data files, one DDP step; no eval, no checkpoint);
* ``raytpu --local``: ``raytpu train --local jobs/mshnet/small.yaml loop.max_steps=1`` (local
  processes, no Ray);
* ``raytpu (Ray)``: ``raytpu train jobs/mshnet/small.yaml loop.max_steps=1`` (a local Ray instance,
  a TorchTrainer of 2 workers).

raytpu's figures include what every run does after its last step: one evaluation of the valid
split and the end-of-run checkpoint. The last line is ``ratio=<raytpu --local / torchrun>``
(target <= 1.5).

    python bench/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def timed(command: list[str]) -> float:
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    data = work / "mshnet"
    subprocess.run(
        [str(BIN / "raytpu"), "data", "synth", "mshnet", "--out", str(data), "--n", "200", "--size", "64"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    common = ["jobs/mshnet/small.yaml", "loop.max_steps=1", f"data.path={data}", f"run.storage_path={work / 'runs'}"]
    common.append("logging.progress_bar=false")
    commands = {
        "torchrun": lambda i: [str(BIN / "torchrun"), "--nproc_per_node", "2", "bench/bare_step.py", str(data)],
        "raytpu --local": lambda i: [str(BIN / "raytpu"), "train", "--local", *common, f"run.name=local-{i}"],
        "raytpu (Ray)": lambda i: [str(BIN / "raytpu"), "train", *common, f"run.name=ray-{i}"],
    }
    seconds: dict[str, list[float]] = {name: [] for name in commands}
    for repeat in range(args.repeats):
        for name, command in commands.items():
            seconds[name].append(timed(command(repeat)))
        print(f"repeat {repeat}: " + ", ".join(f"{n} {s[-1]:.1f} s" for n, s in seconds.items()), flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    for name, value in medians.items():
        print(
            f"{name:>15}: {value:6.1f} s (median of {args.repeats}; min {min(seconds[name]):.1f}, "
            f"max {max(seconds[name]):.1f})"
        )
    print("raytpu figures include one evaluation of the valid split and the end-of-run checkpoint")
    print(f"ratio={medians['raytpu --local'] / medians['torchrun']:.3f}")


if __name__ == "__main__":
    main()
