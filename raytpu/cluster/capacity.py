"""What the connected Ray cluster offers a run, and the wait for nodes its autoscaler starts.

``ray.cluster_resources()`` counts only the nodes that are up: on a cluster whose accelerator node
types start on demand it shows no TPU and no GPU until something asks for one. So the offer
(:class:`~raytpu.runtime.placement.ClusterOffer`) adds the node types the cluster's autoscaler may
start, read from the first of:

1. Ray's cluster config record (``ray._private.state.state.get_cluster_config()``), which Ray Train
   and Ray Data read for their own checks, where an autoscaler publishes it;
2. the autoscaling config the head's autoscaler was started with (``ray up`` starts it with
   ``--autoscaling-config=~/ray_bootstrap_config.yaml``; Ray 2.60's own autoscaler publishes no
   record), read on the head node: in this process when it runs there (``raytpu submit``'s jobs
   do), else by a zero-CPU task placed on the head.

Before a run whose workers wait for nodes to start, :func:`wait_for_nodes` holds a placement group
of the workers' bundles (the demand the autoscaler acts on), says what it waits for (the
autoscaler's pending launches) and gives up after ``scaling.node_start_timeout_s``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from raytpu.errors import RunFailed
from raytpu.runtime.placement import CHECKED, Bundle, ClusterOffer, NodeType, describe

#: the option of the autoscaler's monitor process that names its config file
CONFIG_OPTION = "--autoscaling-config="
#: seconds between two "waiting for ..." lines
SAY_EVERY_S = 15.0
#: node types already read, by the cluster's GCS address (one look per cluster and process)
_KNOWN: dict[str, tuple[tuple[NodeType, ...], str]] = {}


class NodesNotStarted(RunFailed):
    """The autoscaler did not start the nodes a run waits for within its time limit."""


def read_offer(this_machine: bool) -> ClusterOffer:
    """The connected cluster: its live nodes, what is free, and (unless it is raytpu's own local
    instance, which never grows) the node types its autoscaler may start."""
    import ray

    nodes = tuple(
        {k: float(v) for k, v in node["Resources"].items() if k in CHECKED or k.startswith(("accelerator", "TPU-"))}
        for node in ray.nodes()
        if node.get("Alive")
    )
    available = {k: float(v) for k, v in ray.available_resources().items()}
    node_types, source = ((), "") if this_machine else cluster_node_types()
    return ClusterOffer(nodes, available, node_types, source, this_machine)


def cluster_node_types() -> tuple[tuple[NodeType, ...], str]:
    """The node types the autoscaler may start and where they were read (``((), "")``: no autoscaler)."""
    import ray

    address = ray.get_runtime_context().gcs_address
    if address not in _KNOWN:
        _KNOWN[address] = published_node_types() or head_node_types(address) or ((), "")
    return _KNOWN[address]


def published_node_types() -> tuple[tuple[NodeType, ...], str] | None:
    from ray._private.state import state

    try:
        config = state.get_cluster_config()
    except Exception:  # an older GCS without the record
        return None
    types = node_types_of_record(config) if config is not None else ()
    return (types, "Ray's cluster config record") if types else None


def node_types_of_record(config: Any) -> tuple[NodeType, ...]:
    """The node types of Ray's ``autoscaler_pb2.ClusterConfig``."""
    return tuple(
        NodeType(group.name, dict(group.resources), int(group.max_count), int(group.min_count))
        for group in config.node_group_configs
    )


def node_types_of_config(config: Mapping[str, Any]) -> tuple[NodeType, ...]:
    """The worker node types of an autoscaling config (``cluster.yaml``'s format), the head's left out."""
    head, default_max = config.get("head_node_type"), int(config.get("max_workers", 0))
    return tuple(
        NodeType(
            name,
            {k: float(v) for k, v in (spec.get("resources") or {}).items()},
            int(spec.get("max_workers", default_max)),
            int(spec.get("min_workers", 0)),
            hosts_per_launch(spec.get("node_config") or {}),
        )
        for name, spec in (config.get("available_node_types") or {}).items()
        if name != head
    )


def hosts_per_launch(node_config: Mapping[str, Any]) -> int:
    """The Ray nodes one launch of a GCP node type brings up: a TPU slice's hosts, else one."""
    from raytpu.runtime.tpu import parse_pod_type, slice_spec

    accelerator = node_config.get("acceleratorConfig") or {}
    try:
        if node_config.get("acceleratorType"):
            return parse_pod_type(str(node_config["acceleratorType"])).num_hosts
        if accelerator.get("type") and accelerator.get("topology"):
            return slice_spec(str(accelerator["type"]), str(accelerator["topology"])).num_hosts
    except ValueError:  # a GPU's acceleratorType, or a TPU type raytpu does not know
        pass
    return 1


def head_node_types(gcs_address: str) -> tuple[tuple[NodeType, ...], str] | None:
    """The node types of the autoscaling config the cluster's autoscaler runs with, read on the head."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    found = autoscaling_config_here(gcs_address)
    head = next((n for n in ray.nodes() if n.get("Alive") and "node:__internal_head__" in n["Resources"]), None)
    if found is None and head is not None and head["NodeManagerAddress"] != ray.util.get_node_ip_address():
        read = ray.remote(num_cpus=0, max_retries=0)(autoscaling_config_here)
        strategy = NodeAffinitySchedulingStrategy(head["NodeID"], soft=False)
        try:
            found = ray.get(read.options(scheduling_strategy=strategy).remote(gcs_address), timeout=30)
        except Exception:  # a head that cannot run a task: the live nodes are all that is known
            found = None
    if not found:
        return None
    path, config = found
    return node_types_of_config(config), f"the autoscaling config on the head ({path})"


def autoscaling_config_here(gcs_address: str) -> tuple[str, dict[str, Any]] | None:
    """``(path, config)`` of the autoscaler serving ``gcs_address`` if it runs on this machine: the
    file its monitor process was started with."""
    import psutil
    import yaml

    for process in psutil.process_iter(["cmdline"]):
        args = process.info["cmdline"] or []
        if f"--gcs-address={gcs_address}" not in args:
            continue
        path = next((a[len(CONFIG_OPTION) :] for a in args if a.startswith(CONFIG_OPTION)), None)
        if path and os.path.isfile(os.path.expanduser(path)):
            with open(os.path.expanduser(path)) as handle:
                return path, yaml.safe_load(handle) or {}
    return None


# ------------------------------------------------------------------ waiting
def wait_for_nodes(
    bundles: Sequence[Bundle], what: str, timeout_s: float, offer: ClusterOffer, held_by_others: bool = False
) -> None:
    """Hold the workers' bundles as a placement group until they fit (the autoscaler has started
    nodes for them, or, ``held_by_others``, other work has freed what it holds), then release it
    (the run's own placement group fits at once), printing what it waits for every
    :data:`SAY_EVERY_S` seconds; :class:`NodesNotStarted` after ``timeout_s``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    limit = f"giving up after {timeout_s:g} s (scaling.node_start_timeout_s)"
    if held_by_others:
        print(f"raytpu: {what} ({describe(bundles[0])} each) wait for resources other work holds; {limit}", flush=True)
    else:
        types = ", ".join(t.name for t in offer.node_types)
        print(
            f"raytpu: {what} ({describe(bundles[0])} each) wait for the autoscaler to start nodes "
            f"(node types: {types}); {limit}",
            flush=True,
        )
    group = placement_group(list(bundles), strategy="PACK")
    ready = group.ready()
    start = time.monotonic()
    said = start
    try:
        while not ray.wait([ready], timeout=1.0)[0]:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise NodesNotStarted(gave_up(waited, what, bundles[0], held_by_others))
            if time.monotonic() - said >= SAY_EVERY_S:
                said = time.monotonic()
                doing = "other work still holds them" if held_by_others else pending_launches() or "no launch yet"
                print(f"raytpu: waiting {waited:.0f} s: {doing}", flush=True)
    finally:
        remove_placement_group(group)
    print(
        f"raytpu: {'resources free' if held_by_others else 'nodes up'} after {time.monotonic() - start:.0f} s",
        flush=True,
    )


def gave_up(waited: float, what: str, bundle: Bundle, held_by_others: bool) -> str:
    if held_by_others:
        return (
            f"gave up after {waited:.3g} s waiting for {what} ({describe(bundle)} each): other work on the cluster "
            "holds what they need (see `ray status`); stop it, raise scaling.node_start_timeout_s, or ask for fewer "
            "workers (scaling.num_workers)"
        )
    return (
        f"gave up after {waited:.3g} s waiting for the autoscaler to start nodes for {what} "
        f"({describe(bundle)} each; {pending_launches() or 'nothing launching'}): raise "
        "scaling.node_start_timeout_s, or see why with `ray status` and the autoscaler's log"
    )


def pending_launches() -> str:
    """The autoscaler's launches in progress, in words (``launching tpu_v5e_8 x1``); "" when it
    says nothing (an autoscaler that reports no status)."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    try:
        status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=5)
    except Exception:
        return ""
    parts = [f"launching {launch.ray_node_type_name} x{launch.count}" for launch in status.pending_launches]
    parts += [
        f"{node.ray_node_type_name} starting ({node.details or node.node_status})" for node in status.pending_nodes
    ]
    parts += [
        f"{launch.ray_node_type_name} failed to launch ({launch.details or 'see the autoscaler log'})"
        for launch in status.failed_launches
    ]
    return "; ".join(parts)
