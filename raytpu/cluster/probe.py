"""What a Ray cluster holds, found without hanging (``raytpu doctor``): where its address listens (a
TCP check answers in seconds where nothing does), then its nodes and the node types its autoscaler
may start, listed from a subprocess with a timeout (joining a cluster as a driver can block)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from raytpu.cluster.connect import DEFAULT_TIMEOUT_S, auth_headers, host_port, one_line, tcp_error

NO_CLUSTER = "no cluster: raytpu starts a local one"
PROBE_MARK = "RAYTPU_CLUSTER "
PROBE_ERROR_MARK = "RAYTPU_CLUSTER_ERROR "


def node_summary(node_id: str, ip: str, alive: bool, resources: dict, labels: dict) -> dict[str, Any]:
    keep = ("CPU", "GPU", "TPU")
    wanted = {k: v for k, v in resources.items() if k in keep or k.startswith(("accelerator_type:", "TPU-"))}
    tpu_labels = {k: v for k, v in (labels or {}).items() if k.startswith("ray.io/tpu")}
    return {"node_id": node_id[:12], "ip": ip, "alive": alive, "resources": wanted, "tpu_labels": tpu_labels}


def list_cluster_nodes(address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Nodes of the cluster at ``address``, and the node types its autoscaler may start (runs in the
    probe subprocess: it connects as a Ray driver)."""
    if address.startswith(("http://", "https://")):
        return probe_through_dashboard(address, timeout_s)
    import ray

    from raytpu.cluster.capacity import cluster_node_types

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        nodes = [
            node_summary(n["NodeID"], n["NodeManagerAddress"], n["Alive"], n["Resources"], n.get("Labels", {}))
            for n in ray.nodes()
        ]
        types, source = cluster_node_types()
        return {"nodes": nodes, "node_types": [dataclasses.asdict(t) for t in types], "node_types_from": source}
    finally:
        ray.shutdown()


def probe_through_dashboard(address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """What :func:`list_cluster_nodes` finds, for a cluster known by its dashboard's address (the
    form ``raytpu submit`` and the cluster walk-through use): the probe runs on the head as a short
    Ray job, where the autoscaler's node types are read; a head that cannot run it (raytpu not
    installed there) gives the live nodes alone, through the dashboard's state API."""
    import time

    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(address, headers=auth_headers())
    code = "import sys; from raytpu.cluster.probe import cluster_probe_main; sys.exit(cluster_probe_main('auto'))"
    job = client.submit_job(entrypoint=f"python -c {shlex.quote(code)}", metadata={"raytpu": "doctor"})
    deadline = time.monotonic() + timeout_s
    while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        if time.monotonic() > deadline:
            client.stop_job(job)
            break
        time.sleep(0.5)
    for line in client.get_job_logs(job).splitlines():
        if line.startswith(PROBE_MARK):
            return json.loads(line[len(PROBE_MARK) :])
    from ray.util.state import list_nodes

    states = list_nodes(address=address, detail=True, raise_on_missing_output=False)
    nodes = [
        node_summary(n.node_id, n.node_ip, n.state == "ALIVE", n.resources_total or {}, n.labels or {}) for n in states
    ]
    return {"nodes": nodes, "node_types": [], "node_types_from": ""}


def cluster_probe_main(address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> int:
    """Entry point of the cluster probe subprocess: one marked JSON line on stdout."""
    try:
        print(PROBE_MARK + json.dumps(list_cluster_nodes(address, timeout_s)), flush=True)
        return 0
    except Exception as exc:
        print(PROBE_ERROR_MARK + one_line(exc), flush=True)
        return 1


def run_cluster_probe(address: str, timeout: float) -> dict[str, Any]:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    code = (
        "import sys; from raytpu.cluster.probe import cluster_probe_main; "
        "sys.exit(cluster_probe_main(sys.argv[1], float(sys.argv[2])))"
    )
    inner = str(max(timeout - 5.0, timeout * 0.8))  # a job on the head ends, or is stopped, before the probe is
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, address, inner], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired as exc:
        raise ConnectionError(f"no answer within {timeout:g} s") from exc
    for line in done.stdout.splitlines():
        if line.startswith(PROBE_MARK):
            return json.loads(line[len(PROBE_MARK) :])
        if line.startswith(PROBE_ERROR_MARK):
            raise ConnectionError(line[len(PROBE_ERROR_MARK) :])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    raise ConnectionError(f"probe exited with code {done.returncode}: {tail}")


def cluster_totals(nodes: list[dict[str, Any]]) -> dict[str, float]:
    totals = {"CPU": 0.0, "GPU": 0.0, "TPU": 0.0}
    for node in nodes:
        if node["alive"]:
            for key in totals:
                totals[key] += node["resources"].get(key, 0)
    return totals


def check_cluster(address: str | None, timeout: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """Reach the named cluster (or report that raytpu will start a local one) without hanging."""
    if address is None:
        return {"address": None, "reachable": None, "message": NO_CLUSTER, "nodes": []}
    endpoint = host_port(address)
    refused = tcp_error(*endpoint, timeout=min(timeout, 5.0)) if endpoint else None
    if refused:
        return {"address": address, "reachable": False, "message": f"cannot reach {address}: {refused}", "nodes": []}
    try:
        found = run_cluster_probe(address, timeout)
    except ConnectionError as exc:
        return {"address": address, "reachable": False, "message": f"cannot connect to {address}: {exc}", "nodes": []}
    from raytpu.runtime.placement import ClusterOffer, NodeType, choose_runtime

    nodes = found["nodes"]
    totals = cluster_totals(nodes)
    types = tuple(NodeType(**t) for t in found["node_types"])
    offer = ClusterOffer(tuple(n["resources"] for n in nodes if n["alive"]), node_types=types)
    runtime, why = choose_runtime("auto", offer)
    alive = sum(n["alive"] for n in nodes)
    message = f"{alive} alive node(s): {totals['CPU']:g} CPU, {totals['GPU']:g} GPU, {totals['TPU']:g} TPU chips"
    if types:
        message += f"; its autoscaler can start {'; '.join(t.describe() for t in types)} ({found['node_types_from']})"
    return {
        "address": address,
        "reachable": True,
        "message": message,
        "nodes": nodes,
        "node_types": found["node_types"],
        "totals": totals,
        "auto_runtime": runtime,
        "auto_why": why,
    }
