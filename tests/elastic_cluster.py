"""Runs on a Ray cluster of several nodes on this machine, with capacity taken away and given back:
the last scenario of ``tests/multinode_cluster.py`` (it removes nodes), and ``bench/elastic.py``'s.

The cluster (``ray.cluster_utils.Cluster``): a head with no CPU for workers and two nodes of one
CPU each. Each variant is ``raytpu train`` of the toy job, started as a user would, from a
subprocess, each of its steps recorded by the job (``job.seen_dir``: the samples, when, by which
attempt). ``ddp`` and ``fsdp`` run ``scaling.num_workers=1:2``: one node is removed (``ddp``: once
the first checkpoint is written; ``fsdp``: as soon as the driver has said its plan of two workers,
before any ran a step), the run goes on with one worker, the global batch kept, and once the run
says so a node is added back (it grows to two at its next checkpoint). ``fixed`` runs two
workers and one failure allowed, and one worker's process is killed after the first checkpoint:
the restart of a fixed-size run, for comparison. What each variant saw: its exit code, output, seconds,
when each disruption happened (``Cluster.add_node`` must run on the main thread: this process's),
and what the run left (its summary, its checkpoints' records, the samples of every step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
#: 64 samples, a global batch of 8: 8 steps an epoch, 6 epochs; a checkpoint every 4 steps
COMMON = ["data.global_batch_size=8", "loop.epochs=6", "checkpoint.every_steps=4", "loop.log_every=4",
          "job.step_sleep=0.05", "logging.progress_bar=false", "checkpoint.num_to_keep=20",
          "scaling.node_start_timeout_s=120"]  # fmt: skip
ELASTIC = ["scaling.num_workers=1:2"]
VARIANTS = {
    "ddp": ELASTIC,
    "fsdp": [*ELASTIC, "--fsdp", "full_shard"],
    "fixed": ["scaling.num_workers=2", "checkpoint.max_failures=1"],
}
#: ``fsdp`` loses its node as its two workers start: Ray Train waits out its group's start timeout
#: (60 s by default) before it tries one worker; half of it still outlasts a busy machine's start
ENVIRONMENTS = {"fsdp": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30"}}


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def seen_records(seen: Path) -> list[dict[str, Any]]:
    """Every micro-batch the toy job recorded: its step, epoch, samples, time, process and attempt."""
    return [json.loads(line) for path in seen.glob("*.jsonl") for line in path.read_text().splitlines()]


def first_checkpoint(run_dir: Path, log: Path) -> None:
    wait_for(lambda: (run_dir / "checkpoint_00000004" / "meta.json").is_file(), 240, "the first checkpoint")


def plan_line(run_dir: Path, log: Path) -> None:
    """The driver has said its plan: its workers are about to start."""
    wait_for(lambda: " worker(s), " in log.read_text(), 240, "the plan's line")


def lose_and_regain(cluster: Any, run_dir: Path, seen: Path, driver: subprocess.Popen) -> dict[str, float]:
    """A node goes; once the run has said so, one comes back."""
    victim = next(node for node in cluster.worker_nodes if node is not cluster.head_node)
    cluster.remove_node(victim)
    removed = time.time()
    wait_for(lambda: (run_dir / "resizes.json").is_file() or driver.poll() is not None, 240, "a run of one")
    cluster.add_node(num_cpus=1)
    return {"removed_at": removed, "added_at": time.time()}


def kill_a_worker(cluster: Any, run_dir: Path, seen: Path, driver: subprocess.Popen) -> dict[str, float]:
    """One worker's process is killed."""
    os.kill(max(int(path.stem) for path in seen.glob("*.jsonl")), signal.SIGKILL)
    return {"killed_at": time.time()}


#: each variant's disruption, and the moment it waits for
DISRUPTIONS = {
    "ddp": (first_checkpoint, lose_and_regain),
    "fsdp": (plan_line, lose_and_regain),  # early: before any worker ran a step
    "fixed": (first_checkpoint, kill_a_worker),
}


def run_variant(cluster: Any, out: Path, variant: str) -> dict[str, Any]:
    """One run through its disruption; what happened."""
    runs, seen = out / "results", out / f"seen-{variant}"
    seen.mkdir(parents=True)
    config = out / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {out}}}\n")
    run_dir = runs / variant
    words = [*COMMON, *VARIANTS[variant], f"run.storage_path={runs}", f"run.name={variant}", f"job.seen_dir={seen}"]
    log = (out / f"{variant}.log").open("w")
    started = time.monotonic()
    driver = subprocess.Popen(
        [str(VENV_BIN / "raytpu"), "train", str(config), "--address", cluster.address, *words],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **ENVIRONMENTS.get(variant, {})},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    report: dict[str, Any] = {"run_dir": str(run_dir), "seen": str(seen)}
    try:
        moment, disruption = DISRUPTIONS[variant]
        moment(run_dir, out / f"{variant}.log")
        report.update(disruption(cluster, run_dir, seen, driver))
        driver.wait(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    report.update(code=driver.returncode, seconds=time.monotonic() - started)
    report["output"] = (out / f"{variant}.log").read_text()
    return report


def kept_steps(records: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each step as the run kept it: the micro-batches of the last attempt that ran it (steps after a
    lost group's last checkpoint are run again by the next)."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_step[record["step"]].append(record)
    kept = {}
    for step, found in by_step.items():
        last = max(found, key=lambda record: record["time"])["attempt"]
        kept[step] = [record for record in found if record["attempt"] == last]
    return kept


def after(records: list[dict[str, Any]], moment: float) -> tuple[float, int]:
    """``(seconds to the first step after moment, steps run again)``: how long the run stood still
    after a disruption, and the work it lost (steps an earlier attempt ran that a later ran again)."""
    first = min(record["time"] for record in records if record["time"] > moment)
    attempts = defaultdict(set)
    for record in records:
        attempts[record["step"]].add(record["attempt"])
    return first - moment, sum(len(seen) > 1 for seen in attempts.values())


def start_cluster() -> Any:
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # its dashboard: Ray Train's state API
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return cluster


#: the variants the suite runs (bench/elastic.py runs ``fixed`` too)
SUITE_VARIANTS = ("ddp", "fsdp")


def scenario(cluster: Any, out: Path, node_tmp: list[Path]) -> dict[str, Any]:
    """The suite's variants on ``cluster`` (a head without CPUs and two nodes of one CPU), each
    with what its run left in its folder."""
    report = {}
    for variant in SUITE_VARIANTS:
        found = run_variant(cluster, out, variant)
        run_dir = Path(found["run_dir"])
        found["summary"] = json.loads((run_dir / "summary.json").read_text())
        found["metas"] = [json.loads(p.read_text()) for p in sorted(run_dir.glob("checkpoint_*/meta.json"))]
        found["seen"] = seen_records(Path(found["seen"]))
        report[variant] = found
    return report
