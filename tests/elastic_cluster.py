"""Elastic runs on a Ray cluster of several nodes on this machine, a node taken away mid-run and one
given back: ``python -m tests.elastic_cluster OUT VARIANT [VARIANT ...]``, run by
``tests/test_elastic_cluster.py`` in a PID namespace of its own (``unshare -fp --mount-proc``), so
that what this cluster starts ends with it and never touches the test session's Ray.

The cluster (``ray.cluster_utils.Cluster``): a head with no CPU for workers and two nodes of one
CPU each. Each variant (``ddp``, ``fsdp``) is ``raytpu train`` of the toy job with
``scaling.num_workers=1:2``, started as a user would, from a subprocess: once its first checkpoint
is written, one node is removed (the run goes on with one worker, the global batch kept); once the
run says so, a node is added back (the run grows to two at its next checkpoint). Ray Train retries
the old size first and gives a group that cannot start ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``
(15 s here; 60 s by default). Prints one JSON line: for each variant its exit code, output,
seconds, and when the node was removed and added (``Cluster.add_node`` must run on the main
thread: this process's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
#: 64 samples, a global batch of 8: 8 steps an epoch, 6 epochs; a checkpoint every 4 steps
COMMON = ["scaling.num_workers=1:2", "data.global_batch_size=8", "loop.epochs=6", "checkpoint.every_steps=4",
          "loop.log_every=4", "job.step_sleep=0.15", "logging.progress_bar=false", "checkpoint.num_to_keep=20",
          "scaling.node_start_timeout_s=120"]  # fmt: skip
VARIANTS = {"ddp": [], "fsdp": ["--fsdp", "full_shard"]}


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def run_variant(cluster: Any, out: Path, variant: str) -> dict[str, Any]:
    """One elastic run through a node's loss and its return; what happened."""
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
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    report: dict[str, Any] = {"run_dir": str(run_dir), "seen": str(seen)}
    try:
        wait_for(lambda: (run_dir / "checkpoint_00000004" / "meta.json").is_file(), 240, "the first checkpoint")
        victim = next(node for node in cluster.worker_nodes if node is not cluster.head_node)
        cluster.remove_node(victim)
        report["removed_at"] = time.time()
        wait_for(lambda: (run_dir / "resizes.json").is_file() or driver.poll() is not None, 240, "a run of 1")
        cluster.add_node(num_cpus=1)
        report["added_at"] = time.time()
        driver.wait(timeout=400)
    finally:
        if driver.poll() is None:
            driver.kill()
        log.close()
    report.update(code=driver.returncode, seconds=time.monotonic() - started)
    report["output"] = (out / f"{variant}.log").read_text()
    return report


def main(out: Path, variants: list[str]) -> None:
    from ray.cluster_utils import Cluster

    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "15"  # the controller's, on the nodes below
    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # its dashboard: Ray Train's state API
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        report = {variant: run_variant(cluster, out, variant) for variant in variants}
    finally:
        cluster.shutdown()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
