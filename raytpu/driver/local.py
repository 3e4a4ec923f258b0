"""``raytpu train --local``: the plan run by local worker processes, without Ray.

For local multi-process runs while developing: ``scaling.num_workers`` processes started
torchrun-style (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``, a gloo group), each
entering ``raytpu.worker.entry`` as a Ray worker does, with the run folder as its reporter
(``raytpu.worker.reporting.FolderReporter``: the same checkpoint folders, kept by the same rule).
It gives up what Ray adds: restarts of lost workers (``checkpoint.max_failures``), Ray Data across
processes, Tune and remote clusters. Nothing here imports Ray.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from raytpu.config.plan import Plan
from raytpu.driver.signals import StopOnSignal
from raytpu.errors import FIXABLE_MARK, LOG_ONLY_MARK, RunFailed
from raytpu.records.batches import EXIT_BATCH_REDUCED, group_restarts

#: lines of a rank's output the driver keeps in memory: its error, even where the log cannot be written
TAIL_LINES = 200


class RankOutput:
    """A rank's stderr (and stdout, off rank 0): copied to its log and, for rank 0, to our stderr,
    its last lines kept in memory, so that the run's error is said even when the run folder's disk
    is full (a log that cannot be written is given up, the copy to the console goes on)."""

    def __init__(self, path: Path, fresh: bool, console: bool) -> None:
        self.console, self.tail = console, collections.deque(maxlen=TAIL_LINES)
        try:
            self.log: Any = open(path, "w" if fresh else "a")  # noqa: SIM115 (closed by close())
        except OSError:
            self.log = None

    def copy(self, stream: Any) -> None:
        for line in stream:
            # said once, by the driver's error line; a traceback: in the log only
            quiet = line.startswith((FIXABLE_MARK, LOG_ONLY_MARK))
            line = line.removeprefix(FIXABLE_MARK).removeprefix(LOG_ONLY_MARK)
            self.tail.append(line)
            if self.console and not quiet:
                sys.stderr.write(line)
            self._write(line)
        self.close()

    def _write(self, line: str) -> None:
        if self.log is None:
            return
        try:
            self.log.write(line)
        except OSError:  # a full disk: the tail still holds it
            self.close()

    def close(self) -> None:
        log, self.log = self.log, None
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()

    def text(self) -> str:
        return "".join(self.tail)


Worker = tuple[int, subprocess.Popen, RankOutput]  # rank, process, its output


def group_store(world: int) -> Any:
    """The process group's rendezvous store, served by the driver as torchrun's agent serves it
    (``TORCHELASTIC_USE_AGENT_STORE``: every rank a client): bound where the kernel puts it, so no
    other process can take its port between the choice and the bind, as one did here while rank 0
    started up on a port the driver had picked and let go. A fresh one, on a fresh port, for each
    start of the group: a restarted group must not meet the old one's keys."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)


def run_processes(plan: Plan, stop: StopOnSignal) -> None:
    """Run ``scaling.num_workers`` local processes to the end; rank 0's output is the console's,
    the others' go to ``<run dir>/logs/rank_<N>.log``. A failed rank ends the run, unless it stepped
    the batch down (``loop.auto_find_batch_size``): then every process starts again."""
    logs = Path(plan.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    restarts = group_restarts(plan.config)
    with tempfile.TemporaryDirectory(prefix="raytpu-local-") as tmp:
        plan_file = Path(tmp) / "plan.json"
        plan_file.write_text(json.dumps(plan.as_dict()))
        for attempt in range(restarts + 1):
            store = group_store(plan.config.scaling.num_workers)
            processes, copiers = start_workers(plan, plan_file, logs, store.port, fresh_logs=attempt == 0)
            failed = wait_all(processes, copiers)
            outputs = {rank: output for rank, _, output in processes}
            reduced = any(process.returncode == EXIT_BATCH_REDUCED for _, process, _ in processes)
            if not reduced or stop.signum is not None or attempt == restarts:
                break
    if failed is not None:
        text = outputs[failed].text()
        last = (text.strip().splitlines() or ["exited without a message"])[-1]
        raise RunFailed(f"rank {failed}: {last}")  # the worker's line (its traceback: in the rank's log)


def start_workers(
    plan: Plan, plan_file: Path, logs: Path, port: int, fresh_logs: bool
) -> tuple[list[Worker], list[threading.Thread]]:
    """One process per rank, meeting at the driver's store on ``port``; a restarted group adds to
    its ranks' logs."""
    world = plan.config.scaling.num_workers
    # intra-op threads per process as Ray gives its workers (their CPUs; torchrun: 1), so that
    # the processes do not oversubscribe the cores; an OMP_NUM_THREADS set by the user wins
    threads = max(1, int(plan.config.scaling.cpus_per_worker))
    processes: list[Worker] = []
    copiers: list[threading.Thread] = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
        env.update(TORCHELASTIC_USE_AGENT_STORE="True")
        env.setdefault("OMP_NUM_THREADS", str(threads))
        output = RankOutput(logs / f"rank_{rank}.log", fresh_logs, console=rank == 0)
        command = [sys.executable, "-m", "raytpu.worker.entry", str(plan_file)]
        if rank == 0:  # its stdout is the console's; its stderr goes through output
            process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
            stream = process.stderr
        else:  # all it prints goes through output
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            stream = process.stdout
        copiers.append(threading.Thread(target=output.copy, args=(stream,), daemon=True))
        copiers[-1].start()
        processes.append((rank, process, output))
    return processes, copiers


def wait_all(processes: list[Worker], copiers: list[threading.Thread]) -> int | None:
    """Wait for every process; at the first failure stop the others. The failed rank, or None."""
    failed = None
    pending = list(processes)
    while pending:
        time.sleep(0.05)
        for item in [p for p in pending if p[1].poll() is not None]:
            rank, process, _ = item
            pending.remove(item)
            copiers[[p[0] for p in processes].index(rank)].join()
            if process.returncode != 0 and failed is None:
                failed = rank
                for _, other, _ in pending:
                    other.terminate()
    return failed
