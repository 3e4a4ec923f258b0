"""``raytpu train --local``: the same loop in local worker processes, without Ray.

For local multi-process runs while developing: ``scaling.num_workers`` processes started
torchrun-style (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``, a gloo group), each
running the :class:`~raytpu.loop.Trainer` with a reporter that writes the same checkpoint
directories into the same run folder as a Ray run (``<storage>/<run name>/checkpoint_<step>``),
keeps the ``checkpoint.num_to_keep`` best by the job's metric plus the latest, and resumes the
newest complete one when the same command runs again. It gives up what Ray adds: restarts of
lost workers (``checkpoint.max_failures``), Ray Data across processes, Tune and remote clusters.
Nothing here imports Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from raytpu import checkpoint as ckpt
from raytpu.batch_finder import EXIT_BATCH_REDUCED, BatchReduced, fit_finding_batch, group_restarts
from raytpu.checkpoint import LocalReporter
from raytpu.config import Config, ConfigError, dump_yaml, from_dict, to_dict
from raytpu.errors import RunFailed
from raytpu.job import Job
from raytpu.stopping import announce

Worker = tuple[int, subprocess.Popen, Any]  # rank, process, its log file
REPORT = "report.json"  # what a checkpoint was reported with (its score), beside meta.json
STOP = ".stop"  # in the run folder: the driver got a signal; the workers checkpoint and stop


class RunFolderReporter(LocalReporter):
    """Checkpoints in the run folder itself, as Ray lays them out, shared by every local process:
    each rank adds its files to one staging folder, rank 0 publishes it once all are in."""

    def __init__(self, run_dir: Path, num_to_keep: int, mode: str, rank: int, world: int) -> None:
        super().__init__(run_dir, num_to_keep)
        self.root, self.mode, self.rank, self.world = run_dir, mode, rank, world

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is None:
            return
        staging = self.root / f".{name}.partial"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        self._barrier()
        shutil.copytree(checkpoint_dir, staging, dirs_exist_ok=True)
        self._barrier()
        if self.rank == 0:
            ckpt.save_json(staging / REPORT, metrics)
            target = self.root / name
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            self._prune()
        self._barrier()

    def interruption(self) -> str | None:
        """``"stop"`` once the driver wrote the stop file (rank 0 looks, every rank gets its answer)."""
        stop = [self.rank == 0 and (self.root / STOP).exists()]
        if self.world > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(stop, src=0)
        return "stop" if stop[0] else None

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _prune(self) -> None:
        """Keep the ``num_to_keep`` best by score and the latest, as Ray Train does."""
        found = [p for p in self.complete() if p.name.startswith("checkpoint_")]
        if len(found) <= self.num_to_keep:
            return
        best = sorted(found[:-1], key=score_of, reverse=self.mode == "max")
        keep = set(best[: self.num_to_keep]) | {found[-1]}
        for old in found:
            if old not in keep:
                shutil.rmtree(old)

    def best_checkpoint(self) -> Path | None:
        found = [p for p in self.complete() if p.name.startswith("checkpoint_")]
        return (max if self.mode == "max" else min)(found, key=score_of) if found else None


def score_of(directory: Path) -> float:
    report = directory / REPORT
    return float(json.loads(report.read_text()).get("score", 0.0)) if report.is_file() else 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_local(cfg: Config) -> None:
    if cfg.data.loader == "ray":
        raise ConfigError("--local runs without Ray: data.loader=ray needs it; use data.loader=torch or drop --local")
    if cfg.scaling.runtime == "xla" and cfg.scaling.num_workers > 1:
        raise ConfigError("--local with runtime=xla runs one worker (use xla.spmd=true for several devices)")


def train(cfg: Config, job: Job, data_root: Path, run_dir: Path) -> dict[str, Any]:
    """Run ``scaling.num_workers`` local processes to the end; rank 0's output is the console's,
    the others' go to ``<run dir>/logs/rank_<N>.log``. A failed rank ends the run, unless it stepped
    the batch down (``loop.auto_find_batch_size``): then every process starts again."""
    check_local(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    (run_dir / "logs").mkdir(exist_ok=True)
    payload = run_dir / ".local-payload.json"
    payload.write_text(json.dumps({"config": to_dict(cfg), "run_dir": str(run_dir), "data_root": str(data_root)}))
    restarts = group_restarts(cfg)
    with stop_file_on_signal(run_dir / STOP) as stop:
        for attempt in range(restarts + 1):
            processes, copiers = start_workers(cfg, run_dir, payload, fresh_logs=attempt == 0)
            failed = wait_all(processes, copiers)
            reduced = any(process.returncode == EXIT_BATCH_REDUCED for _, process, _ in processes)
            if not reduced or stop.signum is not None or attempt == restarts:
                break
    payload.unlink()
    if failed is not None:
        text = (run_dir / "logs" / f"rank_{failed}.log").read_text()
        last = (text.strip().splitlines() or ["exited without a message"])[-1]
        raise RunFailed(f"rank {failed}: {last}", text if failed else "")
    return summary(job, run_dir, cfg.checkpoint.num_to_keep, stop.signum)


def start_workers(
    cfg: Config, run_dir: Path, payload: Path, fresh_logs: bool
) -> tuple[list[Worker], list[threading.Thread]]:
    """One process per rank, on a fresh port (a restarted group must not meet the old one's); a
    restarted group adds to its ranks' logs."""
    world, port = cfg.scaling.num_workers, free_port()
    # intra-op threads per process as Ray gives its workers (their CPUs; torchrun: 1), so that
    # the processes do not oversubscribe the cores; an OMP_NUM_THREADS set by the user wins
    threads = max(1, int(cfg.scaling.cpus_per_worker))
    processes: list[Worker] = []
    copiers: list[threading.Thread] = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
        env.setdefault("OMP_NUM_THREADS", str(threads))
        log = open(run_dir / "logs" / f"rank_{rank}.log", "w" if fresh_logs else "a")  # noqa: SIM115 (closed by wait_all)
        command = [sys.executable, "-m", "raytpu.local", str(payload)]
        if rank == 0:  # its output is the console's; its errors are kept too
            process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
            copiers.append(threading.Thread(target=tee, args=(process.stderr, log), daemon=True))
            copiers[-1].start()
        else:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
        processes.append((rank, process, log))
    return processes, copiers


def summary(job: Job, run_dir: Path, num_to_keep: int, signum: int | None) -> dict[str, Any]:
    """What the launcher prints at the end: the run's checkpoints and its last metrics."""
    reporter = RunFolderReporter(run_dir, num_to_keep, job.main_metric_mode, 0, 1)
    latest, best = reporter.latest_checkpoint(), reporter.best_checkpoint()
    metrics = json.loads((latest / REPORT).read_text()) if latest and (latest / REPORT).is_file() else {}
    stopped = signum if signum is not None and (run_dir / STOP).exists() else None
    (run_dir / STOP).unlink(missing_ok=True)
    return {
        "stopped_by": stopped,
        "metrics_step": metrics.get("step"),
        "run_dir": str(run_dir),
        "tensorboard": str(run_dir / "tensorboard"),
        "latest_checkpoint": str(latest) if latest else None,
        "best_checkpoint": str(best) if best else None,
        "metrics": {k: v for k, v in metrics.items() if "/" in k},
    }


class stop_file_on_signal:  # noqa: N801 (a context manager, used as a function)
    """SIGINT / SIGTERM to this process: write ``path``, which the workers' rank 0 checks at every
    log step (the workers ignore SIGINT themselves: a Ctrl-C reaches the whole process group)."""

    def __init__(self, path: Path) -> None:
        self.path, self.signum, self.previous = path, None, {}

    def __enter__(self) -> stop_file_on_signal:
        self.path.unlink(missing_ok=True)
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        signal.signal(signum, self.previous[signum])
        announce(signum)
        self.path.write_text("stop\n")

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def tee(stream: Any, log: Any) -> None:
    """Copy a process's stderr to ours and to its log, line by line."""
    for line in stream:
        sys.stderr.write(line)
        log.write(line)
    log.flush()


def wait_all(processes: list[Worker], copiers: list[threading.Thread]) -> int | None:
    """Wait for every process; at the first failure stop the others. The failed rank, or None."""
    failed = None
    pending = list(processes)
    while pending:
        time.sleep(0.05)
        for item in [p for p in pending if p[1].poll() is not None]:
            rank, process, log = item
            pending.remove(item)
            if rank == 0:
                for copier in copiers:
                    copier.join()
            log.close()
            if process.returncode != 0 and failed is None:
                failed = rank
                for _, other, _ in pending:
                    other.terminate()
    return failed


def worker_main(payload_path: str) -> None:
    """One local worker: the process group, the runtime and the loop."""
    import torch.distributed as dist

    from raytpu.logger import muted_stdout
    from raytpu.loop import Trainer
    from raytpu.runtime import make_runtime

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides (see stop_file_on_signal)
    payload = json.loads(Path(payload_path).read_text())
    cfg, job = from_dict(payload["config"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        with muted_stdout(not cfg.logging.verbose):  # gloo's "[Gloo] Rank N is connected" notice
            dist.init_process_group("nccl" if cfg.scaling.runtime == "cuda" else "gloo")
    runtime = make_runtime(cfg.scaling.runtime, cfg.scaling.precision, world, rank, rank, cfg.xla)
    run_dir = Path(payload["run_dir"])
    reporter = RunFolderReporter(run_dir, cfg.checkpoint.num_to_keep, job.main_metric_mode, rank, world)
    data_root = Path(payload["data_root"])

    def fit(cfg: Config) -> dict[str, float]:
        return Trainer(cfg, job, runtime, run_dir, data_root, reporter).fit()

    try:
        fit_finding_batch(cfg, runtime, run_dir, fit)
    except BatchReduced as exc:  # the driver restarts every rank; the others may be mid-collective
        print(f"raytpu: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_BATCH_REDUCED)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    worker_main(sys.argv[1])
