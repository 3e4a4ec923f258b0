"""CDEIT small: training samples/s on the cpu runtime and on the xla runtime (CPU PJRT device).

Each runtime runs in its own process (torch_xla reads PJRT_DEVICE once per
process), alternating, best of ``--repeats``; the same raytpu loop, model,
batch and data. The last line is ``ratio=<xla/cpu>``.

    python bench/cdeit_throughput.py [--steps 20] [--batch 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loop_overhead import raytpu_loop, settings  # noqa: E402

from raytpu.config import load_config  # noqa: E402


def measure(runtime: str, data_dir: Path, warmup: int, steps: int, batch: int) -> float:
    cfg, job = load_config(ROOT / "jobs/cdeit/small.yaml", settings("cdeit", data_dir, warmup + steps, batch))
    return raytpu_loop(cfg, job, data_dir, warmup, steps, runtime=runtime)


def run_child(runtime: str, data_dir: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        __file__,
        "--child",
        runtime,
        "--data",
        str(data_dir),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["samples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=["cpu", "xla"])
    parser.add_argument("--data", type=Path)
    args = parser.parse_args()
    if args.child:
        rate = measure(args.child, args.data, args.warmup, args.steps, args.batch)
        print(json.dumps({"runtime": args.child, "samples_per_s": rate}))
        return
    from raytpu.jobs.cdeit.synth import synthesize

    data_dir = Path(tempfile.mkdtemp(prefix="bench-cdeit-")) / "cdeit"
    atexit.register(shutil.rmtree, data_dir.parent, True)  # the benchmark keeps only what it prints
    synthesize(data_dir, n_train=128, n_valid=16, n_test=16, size=32, seed=0)
    rates: dict[str, list[float]] = {"cpu": [], "xla": []}
    for repeat in range(args.repeats):
        for runtime in rates:
            rates[runtime].append(run_child(runtime, data_dir, args))
        print(
            f"repeat {repeat}: cpu {rates['cpu'][-1]:.1f} samples/s, xla {rates['xla'][-1]:.1f} samples/s", flush=True
        )
    cpu, xla = max(rates["cpu"]), max(rates["xla"])
    print(f"cdeit small (S=32, hidden 64), batch {args.batch}, fp32, {args.steps} steps after {args.warmup} warm-up")
    print(f"cpu={cpu:.1f} samples/s xla={xla:.1f} samples/s (best of {args.repeats})")
    print(f"ratio={xla / cpu:.3f}")


if __name__ == "__main__":
    main()
