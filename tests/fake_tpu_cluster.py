"""Schedule raytpu's TPU requests on a fake TPU cluster and report where every worker ran: a scenario
of ``tests/multinode_cluster.py``, which adds two v4-16 slices (2 hosts x 4 chips each) to its
cluster for it (and removes them after), each host a ``ray.cluster_utils.Cluster`` node
advertising what Ray advertises on a real TPU VM: resource
``TPU`` (chips), ``accelerator_type:TPU-V4``, ``TPU-v4-16-head`` on host 0, the
``ray.io/tpu-*`` labels, and the ``TPU_*`` variables Ray reads its slice name and worker id from.

For the per-chip layout the driver builds the trainer exactly as ``raytpu train`` does
(``raytpu.driver.ray_trainer.build_trainer``: ``ScalingConfig(**scaling_kwargs(cfg))`` and raytpu's torch
config) and runs a tiny train function with the same scaling and backend: each worker writes
its node, labels and Ray's TPU chip ids to ``OUT/<layout>/rank_<r>.json``, and in the per-chip
layout also the PJRT environment raytpu's xla runtime sets (its description's ``prepare_process``). No XLA is run.

Then an elastic run over whole slices (``scaling.tpu.slices=1:2``, spmd: 2 to 4 workers), with
raytpu's run config (its controller callback): once its group spans both slices, one slice is
removed (both its hosts: a preempted TPU slice goes whole), and the group restarts on the slice
left: its workers are the spmd layout's placement of one slice. Each worker records the
multislice environment raytpu's backend gave it (``MEGASCALE_*``: the group of both slices).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SMALL = Path(__file__).resolve().parents[1] / "jobs" / "mshnet" / "small.yaml"
POD_TYPE, TOPOLOGY, ACCELERATOR, CHIPS_PER_HOST, HOSTS_PER_SLICE = "v4-16", "2x2x2", "TPU-V4", 4, 2
SLICES = ("slice-a", "slice-b")
LAYOUT_WORKERS = {"multiprocess": 8}  # spmd: the elastic run's group of one slice (run_elastic)


def tpu_host(slice_name: str, worker_id: int) -> dict[str, Any]:
    """``Cluster.add_node`` arguments for one host of a v4-16 slice, as Ray sees a real TPU VM."""
    resources = {"TPU": CHIPS_PER_HOST, f"accelerator_type:{ACCELERATOR}": 1}
    if worker_id == 0:
        resources[f"TPU-{POD_TYPE}-head"] = 1
    return {
        "num_cpus": CHIPS_PER_HOST,  # logical CPUs: one per worker of the per-chip layout
        "resources": resources,
        "labels": {
            "ray.io/tpu-slice-name": slice_name,
            "ray.io/tpu-worker-id": str(worker_id),
            "ray.io/tpu-pod-type": POD_TYPE,
            "ray.io/tpu-topology": TOPOLOGY,
        },
        "env_vars": {
            "TPU_NAME": slice_name,
            "TPU_WORKER_ID": str(worker_id),
            "TPU_ACCELERATOR_TYPE": POD_TYPE,
            "TPU_TOPOLOGY": TOPOLOGY,
        },
    }


def placement() -> dict[str, Any]:
    """Where this worker runs: its rank, node, labels and Ray's TPU chips (no torch_xla, no device)."""
    import ray
    import ray.train

    context = ray.train.get_context()
    runtime = ray.get_runtime_context()
    return {
        "rank": context.get_world_rank(),
        "world": context.get_world_size(),
        "node_id": runtime.get_node_id(),
        "labels": runtime.get_node_labels(),
        "tpu_ids": runtime.get_accelerator_ids().get("TPU", []),
        "tpu_visible_chips": os.environ.get("TPU_VISIBLE_CHIPS"),
        "accelerate_device": os.environ.get("ACCELERATE_TORCH_DEVICE"),
        "address": ray.util.get_node_ip_address(),
        "megascale": {name: value for name, value in os.environ.items() if name.startswith("MEGASCALE_")},
    }


def where_am_i(config: dict[str, Any]) -> None:
    """Train function: record this worker's placement."""
    record = placement()
    if config["layout"] == "multiprocess":  # raytpu's own per-chip setup: the env torch_xla would read
        from raytpu.config import from_dict
        from raytpu.runtime.kinds import kind_of

        cfg, _ = from_dict(config["config"])
        record["pjrt_env"] = kind_of("xla").prepare_process(cfg, record["rank"])
    out = Path(config["out"]) / f"rank_{record['rank']}.json"
    out.write_text(json.dumps(record))


def run_layout(layout: str, out: Path) -> None:
    from ray.train import RunConfig
    from ray.train.torch import TorchTrainer

    from raytpu.config import load_config, to_dict, with_values
    from raytpu.config.plan import Facts, make_plan
    from raytpu.driver.ray_trainer import build_trainer

    cfg, _ = load_config(
        SMALL,
        [
            "runtime=xla",
            f"scaling.tpu.accelerator_type={ACCELERATOR}",
            f"scaling.tpu.topology={TOPOLOGY}",
            f"scaling.tpu.layout={layout}",
            f"scaling.num_workers={LAYOUT_WORKERS[layout]}",
            f"run.storage_path={out / 'results'}",
        ],
    )
    named = with_values(cfg, {"run.name": f"fake-tpu-{layout}"})
    plan = make_plan(named, Facts(mode="train", main_metric_mode="max", data_root=str(out)))
    raytpu_trainer = build_trainer(plan)
    records = out / layout
    records.mkdir(parents=True)
    probe = TorchTrainer(
        where_am_i,
        train_loop_config={"out": str(records), "layout": layout, "config": to_dict(cfg)},
        scaling_config=raytpu_trainer.scaling_config,
        torch_config=raytpu_trainer.backend_config,
        run_config=RunConfig(name=f"fake-tpu-{layout}", storage_path=str(out / "results")),
    )
    probe.fit()


def elastic_probe(config: dict[str, Any]) -> None:
    """Train function of the elastic run: each worker records its attempt's size and slice; a
    group of both slices waits until a host is taken away (its group then fails and restarts)."""
    record = placement()
    out = Path(config["out"])
    (out / f"world{record['world']}_rank{record['rank']}.json").write_text(json.dumps(record))
    if record["world"] > HOSTS_PER_SLICE:
        time.sleep(300)  # the test removes slice-b meanwhile


def wait_for_free_chips(chips: int, timeout_s: float = 120) -> None:
    """Until Ray has released every chip of the layout runs: an elastic run starts at the largest
    size that fits, so a slice still held by the last run's workers would start it on one slice."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("TPU", 0) < chips:
        assert time.monotonic() < deadline, f"chips still held: {ray.available_resources()}"
        time.sleep(0.2)


def run_elastic(cluster: Any, hosts: dict[tuple[str, int], Any], out: Path) -> None:
    """``scaling.tpu.slices=1:2`` over the two slices (spmd: 2 to 4 workers); once the group of both
    slices runs, slice-b goes: the group restarts on the slice left. (With one host of slice-b left,
    Ray reserved that slice's head again and waited out its 60 s group start timeout first.)"""
    import threading

    from ray.train.torch import TorchTrainer

    from raytpu.config import load_config, to_dict, with_values
    from raytpu.config.plan import Facts, make_plan
    from raytpu.driver.ray_trainer import build_trainer

    slices = ["runtime=xla", f"scaling.tpu.accelerator_type={ACCELERATOR}", f"scaling.tpu.topology={TOPOLOGY}"]
    words = [*slices, "scaling.tpu.slices=1:2", f"run.storage_path={out / 'results'}", "data.global_batch_size=16"]
    cfg, _ = load_config(SMALL, words)
    plan = make_plan(with_values(cfg, {"run.name": "fake-tpu-elastic"}), Facts(mode="train", data_root=str(out)))
    records = out / "elastic"
    records.mkdir(parents=True)
    planned = {"notes": plan.notes, "scaling": to_dict(plan.config)["scaling"]}
    (out / "elastic_plan.json").write_text(json.dumps(planned))
    raytpu_trainer = build_trainer(plan)
    probe = TorchTrainer(
        elastic_probe,
        train_loop_config={"out": str(records)},
        scaling_config=raytpu_trainer.scaling_config,
        torch_config=raytpu_trainer.backend_config,
        run_config=raytpu_trainer.run_config,  # raytpu's: the elastic watch, retries without limit
    )
    wait_for_free_chips(len(SLICES) * HOSTS_PER_SLICE * CHIPS_PER_HOST)
    done = threading.Event()
    threading.Thread(target=lambda: (probe.fit(), done.set()), daemon=True).start()
    deadline = time.monotonic() + 240
    while len(list(records.glob(f"world{2 * HOSTS_PER_SLICE}_rank*.json"))) < 2 * HOSTS_PER_SLICE:
        started = sorted(path.name for path in records.glob("world*.json"))
        assert time.monotonic() < deadline and not done.is_set(), f"no group of both slices: {started}"
        time.sleep(0.2)
    for worker_id in range(HOSTS_PER_SLICE):  # on the main thread, as Cluster wants it
        cluster.remove_node(hosts[("slice-b", worker_id)])
    assert done.wait(240), "the run did not end on one slice"


def scenario(cluster: Any, out: Path, node_tmp: list[Path]) -> dict[str, Any]:
    """Both slices added to ``cluster``, the runs, what they recorded; slice-a's hosts removed after
    (the elastic run removes slice-b's)."""
    import ray

    hosts = {}
    for slice_name in SLICES:
        for worker_id in range(2):
            hosts[(slice_name, worker_id)] = cluster.add_node(**tpu_host(slice_name, worker_id))
    cluster.wait_for_nodes()
    try:
        if not ray.is_initialized():
            ray.init(address=cluster.address, log_to_driver=False)
        nodes = {n["NodeID"]: n.get("Labels", {}) for n in ray.nodes() if n["Alive"]}
        for layout in LAYOUT_WORKERS:
            run_layout(layout, out)
        run_elastic(cluster, hosts, out)
    finally:
        for host in hosts.values():
            if host in cluster.worker_nodes:  # slice-b's are gone once the elastic run took them away
                cluster.remove_node(host)
    elastic = {
        "plan": json.loads((out / "elastic_plan.json").read_text()),
        "records": [json.loads(p.read_text()) for p in sorted((out / "elastic").glob("world*_rank*.json"))],
        "resizes": json.loads((out / "results" / "fake-tpu-elastic" / "resizes.json").read_text()),
    }
    multiprocess = [json.loads(p.read_text()) for p in sorted((out / "multiprocess").glob("rank_*.json"))]
    return {"nodes": nodes, "elastic": elastic, "multiprocess": multiprocess}
