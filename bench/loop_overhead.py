"""Samples/s of the raytpu training loop vs a bare hand-written PyTorch loop.

Same job, model, batch, optimizer and data, one process, CPU, measured side by
side in one run (alternating, best of ``--repeats``). The last line is
``ratio=<raytpu/bare>``; the target is at least 0.95.

    python bench/loop_overhead.py [--job mshnet] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytpu.config import load_config  # noqa: E402
from raytpu.hooks import Callback  # noqa: E402
from raytpu.job import StepContext  # noqa: E402
from raytpu.runtime import make_runtime  # noqa: E402
from raytpu.worker.loop import Trainer  # noqa: E402
from raytpu.worker.optim import build_optimizer  # noqa: E402
from raytpu.worker.reporting import FolderReporter  # noqa: E402

CONFIGS = {"mshnet": "jobs/mshnet/small.yaml", "cdeit": "jobs/cdeit/small.yaml"}


def settings(job_name: str, data_dir: Path, steps: int, batch: int) -> list[str]:
    return [
        f"data.path={data_dir}",
        f"data.global_batch_size={batch}",
        f"loop.max_steps={steps}",
        "loop.epochs=1000",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"loop.log_every={steps}",
    ]


def bare_loop(cfg, job, data_root: Path, warmup: int, steps: int) -> float:
    """The loop a user would write by hand: no logging, no checkpoints, no sampler."""
    torch.manual_seed(cfg.run.seed)
    dataset = job.build_dataset(cfg, "train", data_root)
    loader = DataLoader(dataset, batch_size=cfg.data.global_batch_size, shuffle=True, drop_last=True)
    model = job.build_model(cfg).train()
    optimizer = build_optimizer(cfg.optim, model.parameters())
    done, start = 0, 0.0
    while done < warmup + steps:
        for batch in loader:
            if done == warmup:
                start = time.perf_counter()
            ctx = StepContext(epoch=done // len(loader), step=done, training=True, config=cfg)
            loss, _ = job.train_step(model, batch, ctx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            done += 1
            if done == warmup + steps:
                break
    return steps * cfg.data.global_batch_size / (time.perf_counter() - start)


class StepTimer(Callback):
    """Wall time of every training step, from its start to its graph having run: what the bare
    loop measures (evaluations and checkpoints between steps are not steps)."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.seconds: dict[int, float] = {}

    def on_step_start(self, trainer, step: int) -> None:
        self.started[step] = time.perf_counter()

    def on_step_end(self, trainer, step: int) -> None:
        self.seconds[step] = time.perf_counter() - self.started[step]


def raytpu_loop(cfg, job, data_root: Path, warmup: int, steps: int, runtime: str = "cpu") -> float:
    """The raytpu Trainer on ``runtime`` (fp32), samples/s over the steps after ``warmup``."""
    run_dir = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    rt = make_runtime(runtime, "fp32", 1, 0, 0, cfg.xla)
    timer = StepTimer()
    Trainer(cfg, job, rt, run_dir, data_root, FolderReporter(run_dir), callbacks=[timer]).fit()
    measured = [timer.seconds[step] for step in range(warmup + 1, warmup + steps + 1)]
    return steps * cfg.data.global_batch_size / sum(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="mshnet", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / args.job
    cfg, job = load_config(CONFIGS[args.job], settings(args.job, data_dir, args.warmup + args.steps, args.batch))
    job.synthesize(data_dir, **job.synth_options(cfg))
    print(f"job={args.job} batch={args.batch} steps={args.steps} threads={torch.get_num_threads()}")
    side_by_side(
        lambda: bare_loop(cfg, job, data_dir, args.warmup, args.steps),
        lambda: raytpu_loop(cfg, job, data_dir, args.warmup, args.steps),
        args.repeats,
        "samples/s",
    )


def side_by_side(bare: Callable[[], float], ours: Callable[[], float], repeats: int, unit: str) -> None:
    """Alternate the two measurements ``repeats`` times; print each round, the best of each and,
    last, ``ratio=<raytpu/bare>`` of the bests."""
    bests = [0.0, 0.0]
    for repeat in range(repeats):
        rates = [bare(), ours()]
        bests = [max(best, rate) for best, rate in zip(bests, rates)]
        print(f"repeat {repeat}: bare {rates[0]:,.2f} {unit}, raytpu {rates[1]:,.2f} {unit}", flush=True)
    print(f"bare={bests[0]:,.2f} {unit} raytpu={bests[1]:,.2f} {unit} (best of {repeats})")
    print(f"ratio={bests[1] / bests[0]:.3f}")


if __name__ == "__main__":
    main()
