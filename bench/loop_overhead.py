"""Samples/s of the raytpu training loop vs a careful hand-written PyTorch loop.

Same job, model, batch, optimizer and data, one process, measured side by side in one run
(alternating, best of ``--repeats``). The hand-written loop is the careful one: a DataLoader with
``--loader-workers`` processes kept across epochs (``persistent_workers``), pinned memory and
non-blocking copies on a GPU. ``--runtime cuda`` runs both on the GPU (``--precision`` there, fp32
by default, timed between synchronizations). The last line is ``ratio=<raytpu/hand-written>``;
the target is at least 0.97.

    python bench/loop_overhead.py [--job mshnet|cdeit|toy] [--runtime cpu|cuda] [--steps 20] [--repeats 3]
    python bench/loop_overhead.py --job toy --steps 400 --loader-workers 0   # host work per step
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import shutil
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

#: the toy job (a 2-layer MLP on 8 features) has next to no compute: what it measures is each loop's
#: own host work per step, the case of a small model on a fast GPU
CONFIGS = {"mshnet": "jobs/mshnet/small.yaml", "cdeit": "jobs/cdeit/small.yaml", "toy": None}
TOY = ["job.name=tests.toy_job", "job.samples=4096", "job.dropout=0"]
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


class Window:
    """Seconds summed over stretches of steps, each opened and closed at a synchronization (on a
    GPU the steps run asynchronously): evaluations and checkpoints between epochs stay outside,
    whatever a loop does between the steps of an epoch is inside."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.opened = device, 0.0, None

    def open(self) -> None:
        if self.opened is None:
            synchronize(self.device)
            self.opened = time.perf_counter()

    def close(self) -> None:
        if self.opened is not None:
            synchronize(self.device)
            self.seconds += time.perf_counter() - self.opened
            self.opened = None


def bare_loop(
    cfg, job, data_root: Path, warmup: int, steps: int, device: str = "cpu", precision: str = "fp32"
) -> float:
    """The loop a careful user writes by hand: loader workers kept across epochs and evaluations,
    the valid split evaluated after each epoch as the raytpu run does, no logging, no checkpoints."""
    torch.manual_seed(cfg.run.seed)
    target = torch.device(device)
    workers = cfg.data.num_workers

    def loader(split: str, batch_size: int, shuffle: bool) -> DataLoader:
        dataset = job.build_dataset(cfg, split, data_root)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=shuffle,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=target.type == "cuda",
        )

    train = loader("train", cfg.data.global_batch_size, True)
    valid = loader("valid", cfg.data.eval_batch_size or cfg.data.global_batch_size, False)
    model = job.build_model(cfg).to(target).train()
    optimizer = build_optimizer(cfg.optim, model, fused=target.type == "cuda")
    dtype = DTYPES[precision]
    autocast = (lambda: torch.autocast(target.type, dtype)) if dtype is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(target.type, enabled=precision == "fp16")
    window, done, total = Window(target), 0, warmup + steps
    while done < total:
        if done >= warmup:
            window.open()
        batches = iter(train)
        for index in range(len(train)):
            if done == warmup:
                window.open()
            batch = {key: value.to(target, non_blocking=True) for key, value in next(batches).items()}
            ctx = StepContext(epoch=done // len(train), step=done, training=True, config=cfg)
            with autocast():
                loss, _ = job.train_step(model, batch, ctx)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            done += 1
            if index == len(train) - 1 or done == total:
                window.close()
            if done == total:
                break
        else:
            evaluate(job, cfg, model, valid, target, autocast)
    return steps * cfg.data.global_batch_size / window.seconds


@torch.no_grad()
def evaluate(job, cfg, model: torch.nn.Module, batches: DataLoader, target: torch.device, autocast) -> None:
    model.eval()
    for step, batch in enumerate(batches):
        batch = {key: value.to(target, non_blocking=True) for key, value in batch.items()}
        with autocast():
            job.eval_step(model, batch, StepContext(epoch=0, step=step, training=False, config=cfg))
    model.train()


class StepTimer(Callback):
    """The raytpu run's :class:`Window` over the steps after ``warmup``: opened at the first timed
    step and at each epoch's first, closed after each epoch's last step and the last timed one."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.first, self.last, self.window = warmup + 1, warmup + steps, Window(device)

    def on_step_start(self, trainer, step: int) -> None:
        if self.first <= step <= self.last:
            self.window.open()

    def on_step_end(self, trainer, step: int) -> None:
        if step == self.last or step % trainer.steps_per_epoch == 0:
            self.window.close()

    def total(self) -> float:
        return self.window.seconds


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
    any; the model sharded as ``cfg.sharding`` says), samples/s over the steps after ``warmup``."""
    run_dir = Path(tempfile.mkdtemp(prefix="bench-loop-"))
    try:
        rt = make_runtime(runtime, precision, 1, 0, 0, cfg.xla, compile_mode=compile_mode, sharding=cfg.sharding)
        timer = StepTimer(warmup, steps, rt.device)
        Trainer(cfg, job, rt, run_dir, data_root, FolderReporter(run_dir), callbacks=[timer]).fit()
        return steps * cfg.data.global_batch_size / timer.total()
    finally:  # its end-of-run checkpoint (9.5 GB at 789 M parameters) is read by nothing
        shutil.rmtree(run_dir, ignore_errors=True)


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
    atexit.register(shutil.rmtree, data_dir.parent, True)
    overrides = settings(args.job, data_dir, args.warmup + args.steps, args.batch, args.loader_workers)
    cfg, job = load_config(CONFIGS[args.job], (TOY if args.job == "toy" else []) + overrides)
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
        args.batch,
    )


def side_by_side(
    bare: Callable[[], float], ours: Callable[[], float], repeats: int, unit: str, per_step: int = 0
) -> None:
    """Alternate the two measurements ``repeats`` times; print each round, the best of each, the
    milliseconds a step of each (given the ``per_step`` units of a step) and, last,
    ``ratio=<raytpu/bare>`` of the bests."""
    bests = [0.0, 0.0]
    for repeat in range(repeats):
        rates = [bare(), ours()]
        bests = [max(best, rate) for best, rate in zip(bests, rates)]
        print(f"repeat {repeat}: hand-written {rates[0]:,.2f} {unit}, raytpu {rates[1]:,.2f} {unit}", flush=True)
    print(f"hand-written={bests[0]:,.2f} {unit} raytpu={bests[1]:,.2f} {unit} (best of {repeats})")
    if per_step:
        hand, raytpu = (1000 * per_step / best for best in bests)
        print(f"ms per step: hand-written {hand:.3f}, raytpu {raytpu:.3f} ({raytpu - hand:+.3f})")
    print(f"ratio={bests[1] / bests[0]:.3f}")


if __name__ == "__main__":
    main()
