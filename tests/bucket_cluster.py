"""A run whose folder is an S3 bucket, on a real multi-node Ray cluster on this machine: a scenario
of ``tests/multinode_cluster.py``, with the S3 server's endpoint and keys in the environment,
which every node reads, as a cloud VM reads its own.

On the cluster's head without CPUs and its two worker nodes of one CPU each, every node with a
temporary folder of its own (``TMPDIR``): MSHNet small trains on 2 workers (one per node) into
``s3://BUCKET/cluster``; one worker is SIGKILLed after the first checkpoint and the run resumes from
the bucket; the same run trains again, uninterrupted, in 2 local processes (``--local``) into a
local folder; ``raytpu test`` evaluates the bucket's final checkpoint. Returns what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tests.stores import BUCKET

TINY = ["job.base_size=32", "job.crop_size=32", "job.warm_epoch=0", "job.synth_n=40", "job.synth_size=32",
        "scaling.num_workers=2", "data.global_batch_size=8", "loop.log_every=1", "logging.progress_bar=false",
        "loop.epochs=3", "checkpoint.num_to_keep=5"]  # fmt: skip
RUNS = f"s3://{BUCKET}/cluster"


def train(config: Path, storage: str, name: str, *extra: str) -> int:
    from raytpu import cli

    return cli.main(["train", str(config), *TINY, f"run.storage_path={storage}", f"run.name={name}", *extra])


def kill_a_worker_after_the_first_checkpoint(folder: object, nodes: list[Path], killed: list[int | str]) -> None:
    """SIGKILL one of the run's Ray Train workers once a checkpoint is whole in the bucket (a
    failed look, a listing the store refused, is tried again; the last one is reported if none
    succeeds, for the test to show). The workers are found by their process title on this
    cluster's worker nodes (their ``TMPDIR``), not through Ray's state API, which looks for a
    dashboard and may find another instance's on this machine."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            names = [n for n in folder.children() if n.startswith("checkpoint_0")]
            if names and folder.exists(f"{names[0]}/meta.json"):
                workers = train_workers(nodes)
                if workers:
                    os.kill(workers[0], signal.SIGKILL)
                    killed[:] = [workers[0]]
                    return
        except Exception as exc:  # noqa: BLE001 - reported in the test's JSON line
            killed[:] = [f"{type(exc).__name__}: {exc}"]
        time.sleep(0.2)


def train_workers(nodes: list[Path]) -> list[int]:
    """The pids of the Ray Train workers running on ``nodes`` (told apart by their ``TMPDIR``)."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            title = (process.info["cmdline"] or [""])[0]
            if title.startswith("ray::RayTrainWorker") and process.environ().get("TMPDIR") in map(str, nodes):
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(found)


def leftovers(folders: list[Path]) -> list[str]:
    """The folders of checkpoint files still on the nodes' own disks: the bucket holds the run's,
    and a worker removes its local copy once stored; only a killed one cannot (the checkpoint it
    was writing when it died, which never reached the bucket and is never resumed from)."""
    files = (p for folder in folders for p in folder.rglob("*") if p.suffix in (".safetensors", ".pt"))
    return sorted({str(p.parent.parent if p.parent.name == "rng" else p.parent) for p in files})


def scenario(cluster: Any, out: Path, node_tmp: list[Path]) -> dict[str, Any]:
    """The run on ``cluster`` (its worker nodes' temporary folders: ``node_tmp``), from ``out``."""
    from raytpu.jobs.mshnet.synth import synthesize
    from raytpu.storage.run_folder import RunFolder

    config = Path(__file__).resolve().parents[1] / "jobs" / "mshnet" / "small.yaml"
    synthesize(out / "data", n=40, size=32, seed=0)
    data = [f"data.path={out / 'data'}"]
    killed: list[int] = []
    folder = RunFolder(f"{RUNS}/killed")
    killer = threading.Thread(target=kill_a_worker_after_the_first_checkpoint, args=(folder, node_tmp, killed))
    killer.start()
    codes = {"killed": train(config, RUNS, "killed", *data, "checkpoint.max_failures=1")}
    killer.join()
    # the reference: the same run uninterrupted, in local processes (--local runs the same loop
    # on the same gloo group, and starts no workers through Ray: seconds instead of half a minute)
    codes["straight"] = train(config, str(out / "results"), "straight", *data, "--local")
    final = max(n for n in folder.children() if n.startswith("checkpoint_0"))
    report = {"codes": codes, "killed": killed, "final": final, "bucket": folder.children()}
    report["tensorboard"] = folder.children("tensorboard")
    report["leftovers"] = leftovers(node_tmp)
    report["local_run_dirs"] = sorted(str(p) for p in Path.cwd().rglob("killed"))
    code = test(config, folder.uri(final), data, out / "test-bucket.json")
    report["test_bucket"] = json.loads((out / "test-bucket.json").read_text()) if code == 0 else code
    return report


def test(config: Path, checkpoint: str, data: list[str], into: Path) -> int:
    """``raytpu test`` of a checkpoint; its metrics line written to ``into``."""
    import contextlib
    import io

    from raytpu import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        where = ["--checkpoint", checkpoint, f"run.storage_path={into.parent}"]
        code = cli.main(["test", str(config), *TINY, *data, *where])
    if code == 0:
        into.write_text(printed.getvalue().strip().splitlines()[-1])
    return code
