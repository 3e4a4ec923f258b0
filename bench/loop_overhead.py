"""Samples/s of the raytpu training loop vs a careful hand-written PyTorch loop.

Same job, model, batch, optimizer and data, one process, measured side by side in one run
(alternating, best of ``--repeats``). The hand-written loop is the careful one: a DataLoader with
``--loader-workers`` processes kept across epochs (``persistent_workers``), pinned memory and
non-blocking copies on a GPU. ``--runtime cuda`` runs both on the GPU (``--precision`` there, fp32
by default, timed between synchronizations). The last line is ``ratio=<raytpu/hand-written>``;
the target is at least 0.97.

    python bench/loop_overhead.py [--job mshnet] [--runtime cpu|cuda] [--steps 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
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
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def settings(job_name: str, data_dir: Path, steps: int, batch: int, loader_workers: int = 0) -> list[str]:
    return [
        f"data.path={data_dir}",
        f"data.global_batch_size={batch}",
        f"data.num_workers={loader_workers}",
        "scaling.num_workers=1",  # one process: the whole batch is this worker's, as in the hand-written loop
        f"loop.max_steps={steps}",
        "loop.epochs=1000",
        "loop.compile=false",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        f"loop.log_every={steps}",
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_loop(
    cfg, job, data_root: Path, warmup: int, steps: int, device: str = "cpu", precision: str = "fp32"
) -> float:
    """The loop a careful user writes by hand: persistent loader workers, no logging, no checkpoints."""
    torch.manual_seed(cfg.run.seed)
    target = torch.device(device)
    dataset = job.build_dataset(cfg, "train", data_root)
    workers = cfg.data.num_workers
    loader = DataLoader(
        dataset,
        batch_size=cfg.data.global_batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        pin_memory=target.type == "cuda",
    )
    model = job.build_model(cfg).to(target).train()
    optimizer = build_optimizer(cfg.optim, model, fused=target.type == "cuda")
    dtype = DTYPES[precision]
    autocast = torch.autocast(target.type, dtype) if dtype is not None else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(target.type, enabled=precision == "fp16")
    done, start = 0, 0.0
    while done < warmup + steps:
        for batch in loader:
            if done == warmup:
                synchronize(target)
                start = time.perf_counter()
            batch = {key: value.to(target, non_blocking=True) for key, value in batch.items()}
            ctx = StepContext(epoch=done // len(loader), step=done, training=True, config=cfg)
            with autocast:
                loss, _ = job.train_step(model, batch, ctx)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            done += 1
            if done == warmup + steps:
                break
    synchronize(target)
    return steps * cfg.data.global_batch_size / (time.perf_counter() - start)


class StepTimer(Callback):
    """Wall time of the training steps after ``warmup``, from the first one's start to the last
    one's end, what the hand-written loop measures. On the CPU each step is timed alone
    (evaluations and checkpoints between steps are not steps); on a GPU, whose steps run
    asynchronously, the window is timed between two synchronizations."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.first, self.last, self.device = warmup + 1, warmup + steps, device
        self.started: dict[int, float] = {}
        self.seconds: dict[int, float] = {}

    def on_step_start(self, trainer, step: int) -> None:
        if step == self.first:
            synchronize(self.device)
        self.started[step] = time.perf_counter()

    def on_step_end(self, trainer, step: int) -> None:
        if self.device.type == "cuda" and step == self.last:
            synchronize(self.device)
            self.seconds = {self.first: time.perf_counter() - self.started[self.first]}
        elif self.device.type != "cuda":
            self.seconds[step] = time.perf_counter() - self.started[step]

    def total(self) -> float:
        return sum(seconds for step, seconds in self.seconds.items() if self.first <= step <= self.last)


def raytpu_loop(
    cfg,
    job,
    data_root: Path,
    warmup: int,
    steps: int,
    runtime: str = "cpu",
    precision: str = "fp32",
    compile_mode: str = "",
) -> float:
    """The raytpu Trainer on ``runtime`` at ``precision`` (torch.compile'd in ``compile_mode``, if
    any), samples/s over the steps after ``warmup``."""
    run_dir = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    rt = make_runtime(runtime, precision, 1, 0, 0, cfg.xla, compile_mode=compile_mode)
    timer = StepTimer(warmup, steps, rt.device)
    Trainer(cfg, job, rt, run_dir, data_root, FolderReporter(run_dir), callbacks=[timer]).fit()
    return steps * cfg.data.global_batch_size / timer.total()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="mshnet", choices=sorted(CONFIGS))
    parser.add_argument("--runtime", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / args.job
    overrides = settings(args.job, data_dir, args.warmup + args.steps, args.batch, args.loader_workers)
    cfg, job = load_config(CONFIGS[args.job], overrides)
    job.synthesize(data_dir, **job.synth_options(cfg))
    print(
        f"job={args.job} runtime={args.runtime} precision={args.precision} batch={args.batch} steps={args.steps} "
        f"loader_workers={args.loader_workers} threads={torch.get_num_threads()}"
    )
    side_by_side(
        lambda: bare_loop(cfg, job, data_dir, args.warmup, args.steps, args.runtime, args.precision),
        lambda: raytpu_loop(cfg, job, data_dir, args.warmup, args.steps, args.runtime, args.precision),
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
        print(f"repeat {repeat}: hand-written {rates[0]:,.2f} {unit}, raytpu {rates[1]:,.2f} {unit}", flush=True)
    print(f"hand-written={bests[0]:,.2f} {unit} raytpu={bests[1]:,.2f} {unit} (best of {repeats})")
    print(f"ratio={bests[1] / bests[0]:.3f}")


if __name__ == "__main__":
    main()
