"""The one way a worker starts, whatever started it.

The driver resolves a :class:`~raytpu.config.plan.Plan` and hands it to every worker as plain
values: Ray Train's ``TorchTrainer`` calls :func:`ray_entry` with it (``raytpu train``, ``test``,
``tune``, ``launch``), ``raytpu train --local`` starts ``python -m raytpu.worker.entry PLAN`` once
per rank (:func:`local_entry`). Each builds its :class:`~raytpu.worker.reporting.Reporter` and
calls :func:`run`, which sets the process up (what its runtime's description asks: a TPU chip's
environment, a compile cache) and runs the training loop, a test, or the user's script (``raytpu
launch``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytpu.config import Config
from raytpu.config.plan import Plan, elastic_sizes, worker_range
from raytpu.errors import FIXABLE_MARK, LOG_ONLY_MARK, WorkerFailed, error_line, fixable_line
from raytpu.job import load_job
from raytpu.records import devices
from raytpu.records.batches import EXIT_BATCH_REDUCED
from raytpu.records.checkpoints import full_disk_in, save_json
from raytpu.records.goodput import Command
from raytpu.runtime.kinds import kind_of
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.batch_finder import BatchReduced, fit_finding_batch
from raytpu.worker.reporting import FolderReporter, RayReporter, Reporter


@dataclass(frozen=True)
class Seat:
    """Where this worker sits in the run: its global rank, the world size and its rank on the node."""

    rank: int
    world: int
    local_rank: int


def work(plan: Plan, seat: Seat, reporter: Reporter, datasets: dict[str, Any] | None = None) -> None:
    """What every worker does: the user's script (``raytpu launch``), or the loop: training (with the
    batch finder when asked) or a test whose metrics rank 0 reports as a file."""
    if plan.mode == "launch":
        from raytpu.worker.script import run_script_worker

        run_script_worker(plan, seat, reporter)
        return
    from raytpu.runtime import make_runtime
    from raytpu.worker.loop import Growth, Trainer

    job = load_job(plan.config.job.name)
    sizes = elastic_sizes(plan.config) if worker_range(plan.config) else []
    cfg = plan.config
    scaling, cache = cfg.scaling, kind_of(cfg.scaling.runtime).compile_cache(cfg, plan.run_dir)
    compile_mode = cfg.loop.compile_mode if cfg.loop.compile == "true" else ""
    runtime = make_runtime(
        scaling.runtime,
        scaling.precision,
        seat.world,
        seat.rank,
        seat.local_rank,
        cfg.xla,
        cache,
        compile_mode=compile_mode,
        tf32=scaling.tf32,
        sharding=cfg.sharding,
        fp8_recipe=scaling.fp8_recipe,
    )
    folder = RunFolder(plan.run_dir)
    if runtime.is_main:
        devices.record(folder, devices.of(runtime, scaling.precision))
    command = Command(plan.facts.command, plan.facts.started) if plan.facts.command else None
    growth = Growth(sizes[-1], sizes[1] - sizes[0]) if sizes else None
    plan = plan.at_size(seat.world, runtime.local_devices)  # an elastic run's batch at the size it got
    cfg = plan.config

    def trainer(cfg: Config) -> Trainer:
        data_root = Path(plan.facts.data_root)
        board = plan.facts.progress_board
        return Trainer(
            cfg, job, runtime, plan.run_dir, data_root, reporter, datasets, command=command, growth=growth, board=board
        )

    if plan.mode == "train":
        fit_finding_batch(plan, runtime, folder, lambda cfg: trainer(cfg).fit())
        return
    metrics = trainer(cfg).test()
    results = Path(tempfile.mkdtemp(prefix="raytpu-test-")) if runtime.is_main else None
    if results is not None:
        save_json(results / "test_metrics.json", metrics)
    reporter.report(metrics, results, "test")


def fixable_of(error: BaseException, run_dir: str) -> str | None:
    """The one line a worker's error is said in, when its user fixes it (a full disk under the run
    folder anywhere in its chain, a checkpoint that cannot be written), else None."""
    return fixable_line(full_disk_in(error, run_dir) or error)


def rank_log(run_dir: str, rank: int) -> str:
    """The rank's log file in the run folder (as its user names it: a path, or a bucket's URI)."""
    return RunFolder(run_dir).uri("logs", f"rank_{rank}.log")


def failure_line(error: BaseException, run_dir: str, rank: int) -> str:
    """What the driver says of a worker's error: the line its user fixes; else the error's type and
    first line, and the log file that holds its traceback."""
    return fixable_of(error, run_dir) or f"{error_line(error)} (traceback: {rank_log(run_dir, rank)})"


# ------------------------------------------------------------------ Ray Train
def ray_entry(plan_values: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of every ``TorchTrainer`` raytpu builds: one call per Ray worker."""
    import ray.train

    plan = Plan.from_dict(plan_values)
    cfg = plan.config
    if not cfg.logging.verbose:
        quiet_reports()
    context = ray.train.get_context()
    seat = Seat(context.get_world_rank(), context.get_world_size(), context.get_local_rank())
    kind_of(cfg.scaling.runtime).prepare_process(cfg, seat.rank)  # a TPU chip's process environment
    reporter = RayReporter(plan.run_dir, seat.rank, seat.world, plan.facts.stop)
    try:
        work(plan, seat, reporter, {name: ray.train.get_dataset_shard(name) for name in plan.datasets})
    except Exception as exc:  # the driver says one line; the traceback goes to the rank's log
        fixable = fixable_of(exc, plan.run_dir)
        if plan.mode == "launch" and not fixable:  # the rank's log is the script's: the driver says its error
            raise WorkerFailed(traceback.format_exc().rstrip()) from None
        line = failure_line(exc, plan.run_dir, seat.rank)
        if not fixable:
            with contextlib.suppress(OSError):  # a log that cannot be written: the line still names it
                RunFolder(plan.run_dir).write_text(f"logs/rank_{seat.rank}.log", traceback.format_exc())
        raise WorkerFailed(f"{FIXABLE_MARK}{line}") from None


def quiet_reports() -> None:
    """Ray Train 2.60 logs every report at INFO through a logger named by its source file, outside
    ``ray.train``, where ``RunConfig(logging_config=...)`` does not reach: set that logger's level.
    It also logs a failing training function's traceback, which the driver prints itself (once,
    before its one-line error, or not at all when the line says it all, as for a lost store)."""
    from ray.train.v2._internal import util
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)
    logging.getLogger(util.__name__).setLevel(logging.CRITICAL)
    logging.getLogger("ray.data").setLevel(logging.ERROR)  # an eval set's "execution finished" lines


# ------------------------------------------------------------------ local processes
def local_entry(plan_path: str) -> None:
    """One process of ``raytpu train --local``, started torchrun-style (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``PORT``): its gloo group, then :func:`run` with the run folder as reporter.
    A batch step-down exits with :data:`EXIT_BATCH_REDUCED`, and the driver restarts every rank."""
    import torch.distributed as dist

    from raytpu.console import muted_stdout

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides (raytpu.driver.signals)
    plan = Plan.from_dict(json.loads(Path(plan_path).read_text()))
    cfg = plan.config
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    seat = Seat(rank, world, int(os.environ.get("LOCAL_RANK", rank)))
    if world > 1:
        with muted_stdout(not cfg.logging.verbose):  # gloo's "[Gloo] Rank N is connected" notice
            dist.init_process_group(kind_of(cfg.scaling.runtime).process_group)
    keep, mode = cfg.checkpoint.num_to_keep, plan.facts.main_metric_mode
    reporter = FolderReporter(Path(plan.run_dir), keep, mode, rank, world, plan.facts.stop)
    try:
        work(plan, seat, reporter)
    except BatchReduced as exc:  # the driver restarts every rank; the others may be mid-collective
        print(f"raytpu: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_BATCH_REDUCED)
    except Exception as exc:
        if not fixable_of(exc, plan.run_dir):  # the traceback to the rank's log only (the driver copies it there)
            for text in traceback.format_exc().rstrip().splitlines():
                print(f"{LOG_ONLY_MARK}{text}", file=sys.stderr)
        print(f"{FIXABLE_MARK}{failure_line(exc, plan.run_dir, rank)}", file=sys.stderr, flush=True)  # said once
        sys.stdout.flush()
        os._exit(1)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    local_entry(sys.argv[1])
