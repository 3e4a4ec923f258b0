"""raytpu's TPU requests on a fake TPU cluster (tests/fake_tpu_cluster.py, its own Ray cluster
in a subprocess): spmd puts one worker on every host of one slice, multiprocess one worker on
every chip of one slice."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.integration

CHIPS_PER_HOST = 4
HOSTS_PER_SLICE = 2


@pytest.fixture(scope="module")
def placements(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("fake-tpu")
    done = run_python(["-m", "tests.fake_tpu_cluster", str(out)], env={"RAY_ADDRESS": ""}, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    layouts = {}
    layouts["elastic"] = {
        "plan": json.loads((out / "elastic_plan.json").read_text()),
        "records": [json.loads(p.read_text()) for p in sorted((out / "elastic").glob("world*_rank*.json"))],
        "resizes": json.loads((out / "results" / "fake-tpu-elastic" / "resizes.json").read_text()),
    }
    # spmd on one slice: the elastic run's group once a slice is gone
    layouts["spmd"] = sorted((r for r in layouts["elastic"]["records"] if r["world"] == 2), key=lambda r: r["rank"])
    records = [json.loads(p.read_text()) for p in sorted((out / "multiprocess").glob("rank_*.json"))]
    layouts["multiprocess"] = sorted(records, key=lambda r: r["rank"])
    return {"nodes": json.loads((out / "nodes.json").read_text()), **layouts}


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
