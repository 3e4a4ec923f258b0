"""Where a short run's time goes: MSHNet small on 2 CPU workers, through Ray and through ``--local``.

Each run is ``raytpu train jobs/mshnet/small.yaml loop.epochs=3`` (60 steps, an evaluation and a
checkpoint at each epoch's end) on a data set made beforehand; the bench prints each run's
goodput breakdown as its ``goodput.json`` records it (seconds per category, from the command's
start to its exit) and the wall time measured around the command, and ends with
``goodput=<the Ray run's goodput>``. About 3 minutes on 2 cores.

    python bench/goodput.py [--epochs 3]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(command: list[str]) -> float:
    """Run ``command`` from the repo root; its wall time."""
    start = time.time()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return time.time() - start


def show(name: str, record: dict, measured: float) -> None:
    print(f"{name}: goodput {record['goodput']:.1%} of {record['wall_s']:.1f} s (measured around it: {measured:.1f} s)")
    for category, seconds in record["categories"].items():
        print(f"  {category:>13} {seconds:7.2f} s  {seconds / record['wall_s']:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    atexit.register(shutil.rmtree, work, True)  # the benchmark keeps only what it prints
    data = work / "mshnet"
    synth = [str(BIN / "raytpu"), "data", "synth", "mshnet", "--out", str(data), "--n", "200", "--size", "64"]
    subprocess.run(synth, cwd=ROOT, check=True, capture_output=True)
    common = ["jobs/mshnet/small.yaml", f"loop.epochs={args.epochs}", f"data.path={data}"]
    common += [f"run.storage_path={work / 'runs'}", "logging.progress_bar=false"]
    records = {}
    for name, flags in (("ray", []), ("local", ["--local"])):
        measured = run([str(BIN / "raytpu"), "train", *common, f"run.name={name}", *flags])
        records[name] = json.loads((work / "runs" / name / "goodput.json").read_text())
        show("raytpu (Ray)" if name == "ray" else "raytpu --local", records[name], measured)
    print(f"goodput={records['ray']['goodput']:.3f}")


if __name__ == "__main__":
    main()
