"""Elastic runs on a Ray cluster of several nodes (``tests/elastic_cluster.py``, in a PID namespace of
its own): with ``scaling.num_workers=1:2``, a node removed (after the first checkpoint, or as the
first workers start) and another added once the run has gone on with one worker. Data-parallel and
FSDP2 (resharded from its DCP shards at each size): the run ends 0 with the global batch kept at
every step, every sample of every epoch trained on once across the changes, each change said in
one line and recorded, and a final model that learned as fixed-size runs do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from raytpu.config import load_config
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT, in_own_pid_namespace
from tests.elastic_cluster import kept_steps, seen_records

pytestmark = pytest.mark.integration

VARIANTS = ("ddp", "fsdp")


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix="rtel-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        done = subprocess.run(
            in_own_pid_namespace([sys.executable, "-m", "tests.elastic_cluster", out, *VARIANTS]),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""},
            capture_output=True,
            text=True,
            timeout=900,
        )
        reports = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and reports, done.stdout[-3000:] + done.stderr[-3000:]
        report = json.loads(reports[-1])
        for variant in VARIANTS:  # read what the run left before its folder goes
            found = report[variant]
            run_dir = Path(found["run_dir"])
            found["summary"] = json.loads((run_dir / "summary.json").read_text())
            found["metas"] = [json.loads(p.read_text()) for p in sorted(run_dir.glob("checkpoint_*/meta.json"))]
            found["seen"] = seen_records(Path(found["seen"]))
        return report
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_node_lost_then_given_back_the_run_shrinks_grows_and_ends(runs, variant):
    run = runs[variant]
    assert run["code"] == 0, run["output"][-4000:]
    out = run["output"]
    assert "raytpu: elastic, 1 to 2 workers: 2 x 4 per worker; 1 x 4 per worker x 2 accumulation steps" in out
    # ddp loses its node after a checkpoint; fsdp as its first workers start (the cause then depends
    # on how far they got: a node lost, workers that could not start, or a smaller cluster)
    lost = [line for line in out.splitlines() if line.startswith("raytpu: workers 2 -> 1 (")]
    assert lost and lost[0].endswith("): global batch 8 kept, accumulation 1 -> 2"), out[-4000:]
    assert variant != "ddp" or lost[0].startswith("raytpu: workers 2 -> 1 (node "), lost
    assert "raytpu: workers 1 -> 2 (capacity added): global batch 8 kept, accumulation 2 -> 1" in out
    shown = max(out.find("Traceback"), out.find("Graceful shutdown"), out.find("Failed to query"))
    assert shown < 0, out[max(0, shown - 1500) : shown + 2500]
    summary = run["summary"]
    assert summary["status"] == "completed" and summary["step"] == 48
    sizes = summary["attempts"][0]["workers"]
    assert 1 in sizes and sizes[-1] == 2 and (variant != "ddp" or sizes[0] == 2), sizes
    assert [(c["from"], c["to"]) for c in summary["resizes"]] == [(2, 1), (1, 2)]
    assert {meta["world_size"] for meta in run["metas"]} == {1, 2}
    assert all(meta["sharded"] == (variant == "fsdp") for meta in run["metas"])
    assert summary["goodput"]["categories"]["resizing"] > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_sample_of_every_epoch_once_with_the_global_batch_at_every_size(runs, variant):
    """Each step as the run kept it (the last attempt that ran it: work after a lost node's last
    checkpoint is redone) trains on 8 samples, and each epoch's steps on the 64 samples once."""
    epochs: dict[int, list[int]] = defaultdict(list)
    kept = kept_steps(runs[variant]["seen"])
    assert sorted(kept) == list(range(1, 49))
    for step, records in kept.items():
        indices = [index for record in records for index in record["index"]]
        assert len(indices) == 8, (step, records)
        epochs[records[0]["epoch"]] += indices
    assert sorted(epochs) == list(range(6))
    for epoch, indices in epochs.items():
        assert sorted(indices) == list(range(64)), epoch


def test_the_elastic_model_learns_as_fixed_size_runs_do(runs, tmp_path):
    """Its final valid/mse within the spread of three seeds of the same run on one fixed size."""
    finals = []
    for seed in range(3):
        cfg, job = load_config(None, ["job.name=tests.toy_job", "data.global_batch_size=8", "loop.epochs=6",
                                      "logging.progress_bar=false", f"run.seed={seed}"])  # fmt: skip
        run_dir = tmp_path / str(seed)
        runtime = make_runtime("cpu", "fp32", 1, 0, 0)
        finals.append(Trainer(cfg, job, runtime, run_dir, tmp_path, FolderReporter(run_dir)).fit()["valid/mse"])
    for variant in VARIANTS:
        elastic = runs[variant]["summary"]["metrics"]["valid/mse"]
        assert min(finals) * 0.9 <= elastic <= max(finals) * 1.1, (variant, elastic, finals)
