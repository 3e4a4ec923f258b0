"""Compile time of the causal LM's first training step on the XLA CPU device: decoder layers
unrolled (``xla.scan_layers=false``) against scanned (``xla.scan_layers=true``), at 16 and at 32
layers.

Each configuration runs in a process of its own (torch_xla's compile cache is per process; the
run's persistent cache is off, ``xla.compile_cache=none``), through raytpu's own loop on one CPU
PJRT device with XLA's default flags, as a user's run compiles: ``jobs/causal_lm/small.yaml``'s
Llama (hidden 128) with the layers asked, 8 blocks of 128 tokens a step. What is timed is XLA's
compile time (``CompileTime``) of the graphs the first training step runs: forward, backward and
the AdamW update. The last line is ``ratio=<scanned/unrolled at 32 layers> flat=<scanned 32 /
scanned 16>``; the targets are ratio at most 0.25 and flat at most 1.5.

    python bench/scan_compile.py [--layers 16,32] [--repeats 1]
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

SHAPE = ["job.seq_len=128", "data.global_batch_size=8", "job.sample_tokens=0", "data.max_eval_samples=8"]


def first_step_compile(layers: int, scanned: bool, data: Path, runs: Path) -> dict:
    """Compile seconds and graphs of the first step (in this process: a child of :func:`main`)."""
    import torch_xla.debug.metrics as met

    from raytpu.config import load_config
    from raytpu.config.plan import resolve_config
    from raytpu.hooks import Callback
    from raytpu.records import goodput
    from raytpu.runtime import make_runtime
    from raytpu.storage.run_folder import RunFolder
    from raytpu.worker.loop import Trainer
    from raytpu.worker.reporting import FolderReporter

    def compiled() -> tuple[int, float]:
        data_ = met.metric_data("CompileTime")
        return (data_[0], data_[1] / 1e9) if data_ else (0, 0.0)

    class FirstStep(Callback):
        def __init__(self) -> None:
            self.before, self.found = (0, 0.0), {}

        def on_step_start(self, trainer, step: int) -> None:
            self.before = compiled()

        def on_step_end(self, trainer, step: int) -> None:
            if step == 1:
                after = compiled()
                self.found = {"graphs": after[0] - self.before[0], "seconds": after[1] - self.before[1]}

    words = [*SHAPE, f"job.model_config.num_hidden_layers={layers}", f"xla.scan_layers={str(scanned).lower()}"]
    words += [f"data.path={data}", "loop.max_steps=1", "logging.progress_bar=false", "xla.compile_cache=none"]
    cfg, job = load_config(ROOT / "jobs" / "causal_lm" / "small.yaml", [*words, "scaling.num_workers=1"])
    cfg = resolve_config(cfg, "xla", "bf16")
    runtime = make_runtime("xla", "bf16", 1, 0, 0, cfg.xla, sharding=cfg.sharding)
    run_dir = runs / f"{layers}-{'scanned' if scanned else 'unrolled'}"
    command = goodput.Command()
    goodput.begin(RunFolder(run_dir), command)
    probe = FirstStep()
    Trainer(cfg, job, runtime, run_dir, data, FolderReporter(run_dir), None, [probe], command).fit()
    shutil.rmtree(run_dir, ignore_errors=True)
    return probe.found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="16,32")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (the median is kept)")
    parser.add_argument("--child", nargs=4, metavar=("LAYERS", "SCANNED", "DATA", "RUNS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        layers, scanned, data, runs = args.child
        print(json.dumps(first_step_compile(int(layers), scanned == "1", Path(data), Path(runs))))
        return
    from raytpu.jobs.causal_lm import corpus

    work = Path(tempfile.mkdtemp(prefix="scan-compile-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    corpus.synthesize(work / "data", vocab_size=4096)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # XLA's defaults, as a user's run has them
    found: dict[tuple[int, bool], float] = {}
    for layers in [int(n) for n in args.layers.split(",")]:
        for scanned in (False, True):
            seconds = []
            for _ in range(args.repeats):
                child = [sys.executable, __file__, "--child", str(layers), "1" if scanned else "0"]
                done = subprocess.run(
                    [*child, str(work / "data"), str(work / "runs")], env=env, capture_output=True, text=True
                )
                if done.returncode:
                    sys.exit(done.stderr[-3000:])
                report = json.loads(done.stdout.strip().splitlines()[-1])
                seconds.append(report["seconds"])
            found[(layers, scanned)] = sorted(seconds)[len(seconds) // 2]
            name = "scanned" if scanned else "unrolled"
            print(f"{layers} layers, {name}: first step compiled in {found[(layers, scanned)]:.2f} s", flush=True)
    deepest, shallowest = max(n for n, _ in found), min(n for n, _ in found)
    ratio = found[(deepest, True)] / found[(deepest, False)]
    flat = found[(deepest, True)] / found[(shallowest, True)]
    print(f"ratio={ratio:.3f} flat={flat:.3f}")


if __name__ == "__main__":
    main()
