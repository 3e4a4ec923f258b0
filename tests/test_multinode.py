"""Scenarios on a Ray cluster of several nodes, all on one cluster started once
(``tests/multinode_cluster.py``, in a PID namespace of its own, its scenario that removes nodes
last):

- **a bucket:** MSHNet small on a head and two worker nodes, its folder in S3, a worker SIGKILLed
  and the group restarted from the bucket, bit-identical to a local run; ``raytpu test`` of the
  bucket's checkpoint; nothing left on the nodes' disks;
- **a corpus in S3:** the causal LM streamed by Ray Data at ``seq_len`` 256 and 512;
- **a fake TPU cluster:** raytpu's TPU requests on two fake v4-16 slices (spmd: one worker on every
  host of one slice; multiprocess: one on every chip, with torch_xla's task ids), an elastic range
  of slices that loses one and goes on with the other, the multislice environment of a group of
  both;
- **elastic runs:** ``scaling.num_workers=1:2``, a node removed (after the first checkpoint, or as
  the first workers start) and another added once the run has gone on with one worker.
  Data-parallel and FSDP2 (resharded from its DCP shards at each size): the run ends 0 with the
  global batch kept at every step, every sample of every epoch trained on once across the changes,
  each change said in one line and recorded, and a final model that learned as fixed-size runs do.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from raytpu.config import load_config
from raytpu.runtime import make_runtime
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT, in_own_pid_namespace
from tests.elastic_cluster import SUITE_VARIANTS, kept_steps
from tests.stores import BUCKET

pytestmark = pytest.mark.integration

CHIPS_PER_HOST = 4
HOSTS_PER_SLICE = 2


@pytest.fixture(scope="module")
def cluster(stores) -> dict[str, Any]:
    """What every scenario saw, and its folder (kept until the module's tests are done)."""
    out = Path(tempfile.mkdtemp(prefix="rtmn-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    try:
        done = subprocess.run(
            in_own_pid_namespace([sys.executable, "-m", "tests.multinode_cluster", str(out)]),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""},
            capture_output=True,
            text=True,
            timeout=2400,
        )
        reports = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and reports, done.stdout[-3000:] + done.stderr[-3000:]
        yield {"report": json.loads(reports[-1]), "out": out}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def scenario(cluster: dict[str, Any], name: str) -> tuple[dict[str, Any], Path]:
    """One scenario's report (a scenario that raised fails here, with its traceback) and folder."""
    report = cluster["report"][name]
    assert "error" not in report, report["error"]
    return report, cluster["out"] / name


@pytest.fixture(scope="module")
def elastic(cluster) -> dict[str, Any]:
    return scenario(cluster, "elastic")[0]


@pytest.fixture(scope="module")
def placements(cluster) -> dict[str, Any]:
    found = scenario(cluster, "fake_tpu")[0]
    # spmd on one slice: the elastic run's group once a slice is gone
    spmd = sorted((r for r in found["elastic"]["records"] if r["world"] == 2), key=lambda r: r["rank"])
    return {**found, "spmd": spmd, "multiprocess": sorted(found["multiprocess"], key=lambda r: r["rank"])}


# ------------------------------------------------------------------ a run in S3, a worker killed
def test_a_run_in_s3_on_three_nodes_resumes_after_a_kill_bit_identical_to_a_local_run(cluster):
    """MSHNet small on 2 workers of a head and two worker nodes, its folder in S3: a SIGKILLed
    worker after the first checkpoint, the group restarted from the bucket's checkpoint; the final
    weights equal those of the same run uninterrupted (in 2 local processes) in a local folder, bit
    for bit; ``raytpu test`` of the bucket's final checkpoint gives that run's last evaluation;
    nothing of the run is left on the nodes' disks."""
    report, out = scenario(cluster, "bucket")
    assert report["codes"] == {"killed": 0, "straight": 0}, report
    assert [type(pid) for pid in report["killed"]] == [int], report  # else the error that kept it alive
    assert report["final"] == "checkpoint_00000012"  # 32 train images, 8 a step: 4 steps an epoch, 3 epochs
    assert "config.yaml" in report["bucket"] and report["tensorboard"], report["bucket"]
    assert len(report["leftovers"]) <= 1 and not report["local_run_dirs"], report  # at most the killed worker's
    final = report["final"]
    # MSHNet evaluates on its test split: the same weights' test metrics are the run's last evaluation
    evaluated = json.loads((out / "results" / "straight" / final / "meta.json").read_text())["metrics"]
    expected = {f"test/{name}": evaluated[f"valid/{name}"] for name in ("mIoU", "nIoU", "Pd", "Fa")}
    assert report["test_bucket"] == pytest.approx(expected, rel=1e-6, abs=1e-9), report
    fetched = RunFolder(f"s3://{BUCKET}/cluster/killed").fetch(final)  # a local copy, in a folder of its own
    in_bucket = load_file(fetched / "model.safetensors")
    shutil.rmtree(fetched.parent)
    straight = load_file(out / "results" / "straight" / final / "model.safetensors")
    for key in straight:
        torch.testing.assert_close(in_bucket[key], straight[key], rtol=0, atol=0)


# ------------------------------------------------------------------ a corpus in S3
def test_a_corpus_in_s3_trains_at_256_and_512_tokens_on_three_nodes(cluster):
    """The causal LM streamed from JSON-lines and parquet shards in S3 on two worker nodes and a
    node for the tasks (tests/corpus_cluster.py), at seq_len 256 and 512: each run ends at its last
    step with a finite validation loss, from an index of the bucket's files, with half as many
    blocks at 512."""
    report, _ = scenario(cluster, "corpus")
    for length in ("256", "512"):
        run = report[length]
        assert run["code"] == 0 and run["step"] == 4, report
        assert math.isfinite(run["metrics"]["valid/loss"]), report
        assert run["units"] and all(root.startswith("s3://") for root in run["units"]), report
    assert abs(report["256"]["blocks"] - 2 * report["512"]["blocks"]) <= len(report["512"]["units"]), report


# ------------------------------------------------------------------ a fake TPU cluster
def by_host(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    hosts = defaultdict(list)
    for record in records:
        hosts[record["node_id"]].append(record)
    return hosts


def test_fake_cluster_advertises_two_v4_16_slices(placements: dict[str, Any]) -> None:
    tpu_nodes = [labels for labels in placements["nodes"].values() if "ray.io/tpu-slice-name" in labels]
    assert len(tpu_nodes) == 4
    assert {(n["ray.io/tpu-slice-name"], n["ray.io/tpu-worker-id"]) for n in tpu_nodes} == {
        ("slice-a", "0"),
        ("slice-a", "1"),
        ("slice-b", "0"),
        ("slice-b", "1"),
    }


@pytest.mark.parametrize(("layout", "per_host"), [("spmd", 1), ("multiprocess", CHIPS_PER_HOST)])
def test_one_slice_every_host(placements: dict[str, Any], layout: str, per_host: int) -> None:
    records = placements[layout]
    assert [r["rank"] for r in records] == list(range(HOSTS_PER_SLICE * per_host))
    assert len({r["labels"]["ray.io/tpu-slice-name"] for r in records}) == 1, "the workers span two slices"
    hosts = by_host(records)
    assert len(hosts) == HOSTS_PER_SLICE
    assert {r[0]["labels"]["ray.io/tpu-worker-id"] for r in hosts.values()} == {"0", "1"}
    assert all(len(workers) == per_host for workers in hosts.values())


def test_spmd_worker_holds_every_chip_of_its_host(placements: dict[str, Any]) -> None:
    for record in placements["spmd"]:
        assert sorted(record["tpu_ids"]) == ["0", "1", "2", "3"]
        assert record["tpu_visible_chips"] == "0,1,2,3"


def test_multiprocess_worker_holds_one_chip(placements: dict[str, Any]) -> None:
    for workers in by_host(placements["multiprocess"]).values():
        chips = sorted(chip for r in workers for chip in r["tpu_ids"])
        assert chips == ["0", "1", "2", "3"]
        assert all(r["tpu_visible_chips"] == r["tpu_ids"][0] for r in workers)


@pytest.mark.parametrize("layout", ["spmd", "multiprocess"])
def test_no_torch_tpu_device_on_xla_workers(placements: dict[str, Any], layout: str) -> None:
    """Ray's TPU device manager (torch_tpu) stays out of the way: the workers started, and
    no 'cpu' device is advertised to Hugging Face Accelerate."""
    assert all(r["accelerate_device"] is None for r in placements[layout])


def test_multiprocess_task_ids_follow_the_tpu_worker_id(placements: dict[str, Any]) -> None:
    """torch_xla numbers a chip process worker_id * chips_per_host + local rank; Ray's world ranks
    follow the order it reserved the hosts in, which need not be the worker id order."""
    task_ids = []
    for workers in by_host(placements["multiprocess"]).values():
        worker_id = int(workers[0]["labels"]["ray.io/tpu-worker-id"])
        envs = [r["pjrt_env"] for r in workers]
        assert sorted(int(e["CLOUD_TPU_TASK_ID"]) for e in envs) == [worker_id * CHIPS_PER_HOST + i for i in range(4)]
        assert sorted(e["TPU_VISIBLE_CHIPS"] for e in envs) == ["0", "1", "2", "3"]
        assert {e["TPU_PROCESS_BOUNDS"] for e in envs} == {"2,2,2"}
        assert all(len(e["TPU_PROCESS_ADDRESSES"].split(",")) == 8 for e in envs)
        task_ids += [int(e["CLOUD_TPU_TASK_ID"]) for e in envs]
    assert sorted(task_ids) == list(range(8))


def test_an_elastic_range_of_slices_loses_a_slice_and_goes_on_with_the_other(placements: dict[str, Any]) -> None:
    """``scaling.tpu.slices=1:2``: the plan asks Ray for 2 to 4 spmd workers (whole slices), the group
    spans both slices, and once slice-b is preempted it restarts on slice-a alone, the change recorded."""
    elastic = placements["elastic"]
    scaling = elastic["plan"]["scaling"]
    assert (scaling["min_workers"], scaling["num_workers"]) == (2, 4)
    assert any(note.startswith("elastic, 2 to 4 workers: 4 x 4 per worker; 2 x 4 per worker x 2 accumulation")
               for note in elastic["plan"]["notes"]), elastic["plan"]["notes"]  # fmt: skip
    sizes = {(r["world"], r["labels"]["ray.io/tpu-slice-name"]) for r in elastic["records"]}
    assert {world for world, _ in sizes} == {4, 2}
    assert {name for world, name in sizes if world == 4} == {"slice-a", "slice-b"}
    assert {name for world, name in sizes if world == 2} == {"slice-a"}
    assert [(c["from"], c["to"]) for c in elastic["resizes"]] == [(4, 2)] and "lost" in elastic["resizes"][0]["reason"]


def test_workers_of_two_slices_get_one_coordinator_and_their_slice_ids(placements: dict[str, Any]) -> None:
    """The group of both slices: every worker the same coordinator (slice 0's first host) and number
    of slices, each slice its own id, rank 0's slice first; the group of one slice: no multislice
    environment at all."""
    both = [r for r in placements["elastic"]["records"] if r["world"] == 2 * HOSTS_PER_SLICE]
    envs = [r["megascale"] for r in both]
    assert len({(e["MEGASCALE_COORDINATOR_ADDRESS"], e["MEGASCALE_PORT"]) for e in envs}) == 1, envs
    assert {e["MEGASCALE_NUM_SLICES"] for e in envs} == {"2"}
    ids = {r["labels"]["ray.io/tpu-slice-name"]: set() for r in both}
    for record in both:
        ids[record["labels"]["ray.io/tpu-slice-name"]].add(record["megascale"]["MEGASCALE_SLICE_ID"])
    assert sorted(ids.values(), key=sorted) == [{"0"}, {"1"}], ids
    first = next(r for r in both if r["rank"] == 0)
    assert ids[first["labels"]["ray.io/tpu-slice-name"]] == {"0"}
    coordinator = next(
        r["address"]
        for r in both
        if r["megascale"]["MEGASCALE_SLICE_ID"] == "0" and r["labels"]["ray.io/tpu-worker-id"] == "0"
    )
    assert envs[0]["MEGASCALE_COORDINATOR_ADDRESS"] == coordinator
    assert all(r["megascale"] == {} for r in placements["spmd"])  # one slice: nothing to join


# ------------------------------------------------------------------ elastic runs
@pytest.mark.parametrize("variant", SUITE_VARIANTS)
def test_a_node_lost_then_given_back_the_run_shrinks_grows_and_ends(elastic, variant):
    run = elastic[variant]
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


@pytest.mark.parametrize("variant", SUITE_VARIANTS)
def test_every_sample_of_every_epoch_once_with_the_global_batch_at_every_size(elastic, variant):
    """Each step as the run kept it (the last attempt that ran it: work after a lost node's last
    checkpoint is redone) trains on 8 samples, and each epoch's steps on the 64 samples once."""
    epochs: dict[int, list[int]] = defaultdict(list)
    kept = kept_steps(elastic[variant]["seen"])
    assert sorted(kept) == list(range(1, 49))
    for step, records in kept.items():
        indices = [index for record in records for index in record["index"]]
        assert len(indices) == 8, (step, records)
        epochs[records[0]["epoch"]] += indices
    assert sorted(epochs) == list(range(6))
    for epoch, indices in epochs.items():
        assert sorted(indices) == list(range(64)), epoch


def test_the_elastic_model_learns_as_fixed_size_runs_do(elastic, tmp_path):
    """Its final valid/mse within the spread of three seeds of the same run on one fixed size."""
    finals = []
    for seed in range(3):
        cfg, job = load_config(None, ["job.name=tests.toy_job", "data.global_batch_size=8", "loop.epochs=6",
                                      "logging.progress_bar=false", f"run.seed={seed}"])  # fmt: skip
        run_dir = tmp_path / str(seed)
        runtime = make_runtime("cpu", "fp32", 1, 0, 0)
        finals.append(Trainer(cfg, job, runtime, run_dir, tmp_path, FolderReporter(run_dir)).fit()["valid/mse"])
    for variant in SUITE_VARIANTS:
        final = elastic[variant]["summary"]["metrics"]["valid/mse"]
        assert min(finals) * 0.9 <= final <= max(finals) * 1.1, (variant, final, finals)
