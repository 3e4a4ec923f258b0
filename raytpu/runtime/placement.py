"""Where a run's workers can go, as pure functions: what a cluster has up and what its autoscaler
can start (:class:`ClusterOffer`), the runtime ``auto`` picks from that, the accelerator each
worker of a runtime asks for, and whether the workers fit (now, once nodes start, or never).

A cluster made from ``cluster.yaml`` holds a CPU head and nothing else until a request for a TPU
or a GPU makes its autoscaler start one (every accelerator node type has ``min_workers: 0``): what
is up says nothing about what the run can get, so every decision here looks at the node types the
autoscaler may start as well as at the live nodes. Nothing here imports Ray or touches a device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Bundle = dict[str, float]
#: resources compared between what a run asks and what nodes have
CHECKED = ("CPU", "GPU", "TPU")


@dataclass(frozen=True)
class NodeType:
    """A kind of node an autoscaler may start: its resources, how many of it at most, and the hosts
    one launch brings up (a multi-host TPU slice: each host a Ray node with these resources)."""

    name: str
    resources: Mapping[str, float]
    max_count: int
    min_count: int = 0
    hosts: int = 1

    def describe(self) -> str:
        hosts = f"{self.hosts} hosts of " if self.hosts > 1 else ""
        return f"{self.name} ({hosts}{describe(self.resources)}; at most {self.max_count})"


@dataclass(frozen=True)
class ClusterOffer:
    """What a cluster can give a run: the nodes that are up (each one's total resources), what is
    free now, and the node types its autoscaler may start (none without an autoscaler).
    ``this_machine``: a Ray instance raytpu started here (or ``--local``), which never grows."""

    nodes: tuple[Mapping[str, float], ...] = ()
    available: Mapping[str, float] = field(default_factory=dict)
    node_types: tuple[NodeType, ...] = ()
    node_types_from: str = ""  # where the node types were read, in words
    this_machine: bool = False

    def up(self, resource: str) -> float:
        return sum(node.get(resource, 0.0) for node in self.nodes)

    def startable(self, resource: str) -> tuple[NodeType, ...]:
        """The node types that would bring ``resource`` (and may be started at all)."""
        return tuple(t for t in self.node_types if t.max_count > 0 and t.resources.get(resource, 0) > 0)

    def offers(self, resource: str) -> bool:
        return self.up(resource) > 0 or bool(self.startable(resource))

    def accelerator_types(self, resource: str) -> frozenset[str]:
        """The accelerator types (Ray's ``accelerator_type:<name>`` labels: ``H100``, ``T4``) of the
        nodes that are up or may start with ``resource``; empty where none is labelled."""
        nodes = [node for node in self.nodes if node.get(resource, 0) > 0]
        nodes += [node_type.resources for node_type in self.startable(resource)]
        prefix = "accelerator_type:"
        return frozenset(key[len(prefix) :] for node in nodes for key in node if key.startswith(prefix))

    def capacities(self, limit: int = 64) -> list[Mapping[str, float]]:
        """Every node the run could have: the live ones, then each node type as many times as the
        autoscaler may still start it (its live nodes counted against its maximum)."""
        capacities = list(self.nodes)
        for node_type in self.node_types:
            running = sum(same_accelerators(node, node_type.resources) for node in self.nodes)
            hosts = node_type.max_count * node_type.hosts - running
            capacities += [node_type.resources] * min(limit, max(0, hosts))
        return capacities

    def inventory(self) -> str:
        """The cluster in words: what is up, and what its autoscaler can start."""
        resources = describe(total(self.nodes)) if any(total(self.nodes).values()) else "no CPU, GPU or TPU"
        have = f"{resources} on {len(self.nodes)} node(s)"
        if not self.node_types:
            return have
        types = "; ".join(t.describe() for t in self.node_types)
        return f"{have} up, and its autoscaler can start {types}"


def same_accelerators(node: Mapping[str, float], resources: Mapping[str, float]) -> bool:
    """Whether a live node looks like one of a node type (the same accelerators, their type included)."""

    def key(values: Mapping[str, float]) -> dict[str, float]:
        return {k: v for k, v in values.items() if k in ("GPU", "TPU") or k.startswith("accelerator_type:")}

    return bool(key(resources)) and key(node) == key(resources)


# ----------------------------------------------------------------- runtime
@dataclass(frozen=True)
class Placement:
    """Where a run's workers go: the runtime, how many workers, and the TPU chips each asks for
    (0: none, or a named slice's own share); ``why``: what ``auto`` saw; ``note``: what differs from
    the config, in words."""

    runtime: str
    num_workers: int
    tpu_chips: int = 0
    tpu_slice: tuple[str, str] = ("", "")  # (accelerator_type, topology) the workers form, when several
    why: str = ""
    note: str = ""


def place(
    requested: str, num_workers: int, layout: str, slice_named: bool, offer: ClusterOffer, xla_on_cpu: bool = False
) -> Placement:
    """The placement of ``num_workers`` workers of runtime ``requested`` (maybe ``auto``) on ``offer``,
    ``layout`` being ``scaling.tpu.layout`` and ``slice_named`` whether ``scaling.tpu`` names a slice
    (which then sets each worker's TPU share itself). A runtime whose accelerator the cluster has
    and can start none of says what then (its description's ``no_devices``: xla runs on the CPU
    PJRT device on this machine, or where ``xla_on_cpu`` asks for it; elsewhere a ValueError: the
    user asked for a device that is not there)."""
    from raytpu.runtime.kinds import kind_of

    runtime, why = choose_runtime(requested, offer)
    kind = kind_of(runtime)
    workers, note = num_workers, ""
    if requested == "auto":
        workers = workers_this_machine_holds(kind.accelerator, num_workers, offer)
        if workers < num_workers:
            unit = f"{offer.up('GPU'):g} GPU" if kind.accelerator == "GPU" else "1 TPU host"
            note = (
                f"this machine has {unit} for scaling.num_workers={num_workers}: running {workers} {runtime} "
                f"worker(s) (the global batch stays the same; scaling.runtime=cpu runs {num_workers} CPU workers)"
            )
    chips, tpu_slice = 0, ("", "")
    if kind.accelerator == "TPU" and not slice_named:
        chips = tpu_chips_per_worker(kind.tpu_layout(layout), workers, offer)
        if not chips:
            note = kind.no_devices(offer, xla_on_cpu)
        elif workers > 1 and pack([{"TPU": float(chips)}] * workers, offer.capacities()):
            tpu_slice = slice_of(chips, workers, kind.tpu_layout(layout), offer, runtime)  # Ray Train reserves it
            chips = 0
    return Placement(runtime, workers, chips, tpu_slice, why, note)


def slice_of(chips: int, workers: int, layout: str, offer: ClusterOffer, runtime: str) -> tuple[str, str]:
    """``(accelerator_type, topology)`` of the slice that ``workers`` TPU workers of ``chips`` chips
    each form on the cluster's TPU hosts (the generation from their ``accelerator_type:`` resource,
    GCP's standard topology for the chip count); a ValueError naming the keys to set when unknown."""
    from raytpu.runtime.tpu import GENERATIONS, generation, slice_spec

    hosts = [node for node in offer.capacities() if node.get("TPU", 0) >= chips]
    kinds = {key.split(":", 1)[1] for node in hosts for key in node if key.startswith("accelerator_type:TPU")}
    total_chips = workers * chips if layout == "spmd" else workers
    for kind in sorted(kinds):
        try:
            topology = GENERATIONS[generation(kind).name].standard_topologies[total_chips]
            spec = slice_spec(kind, topology)
        except (KeyError, ValueError):
            continue
        per_worker = spec.chips_per_host if layout == "spmd" else 1
        if per_worker == chips and spec.num_chips == total_chips:
            return kind, topology
    raise ValueError(
        f"{workers} {runtime} workers of {chips} TPU chip(s) each form a TPU slice, which Ray Train reserves "
        "whole, and no standard slice has that many chips: name it with scaling.tpu.accelerator_type and "
        "scaling.tpu.topology (e.g. TPU-V5LITEPOD and 4x4), or a worker count that makes a standard slice"
    )


def choose_runtime(requested: str, offer: ClusterOffer) -> tuple[str, str]:
    """``(runtime, why)``: ``auto`` -> the first runtime, in their ``auto_order`` (TorchTPU where it is
    installed and torch_xla is not, xla, cuda, cpu), whose accelerator the cluster has or can
    start; ``why`` says from what (empty for a runtime the config names)."""
    if requested != "auto":
        return requested, ""
    from raytpu.runtime.kinds import by_auto_order

    for kind in by_auto_order():
        why = kind.auto_reason(offer)
        if why:
            return kind.name, why
    raise AssertionError("the cpu runtime is always there")


def tpu_chips_per_worker(layout: str, num_workers: int, offer: ClusterOffer) -> int:
    """The TPU chips each xla worker asks for when ``scaling.tpu`` names no slice: one chip with one
    process per chip (``multiprocess``); a whole host's chips with one worker per host (``spmd``):
    the largest host of which the cluster has, or can start, ``num_workers``. 0 on a cluster with
    no TPU at all: the workers run XLA on the CPU PJRT device."""
    if not offer.offers("TPU"):
        return 0
    if layout == "multiprocess":
        return 1
    hosts = [node.get("TPU", 0.0) for node in offer.capacities()]
    for chips in sorted({h for h in hosts if h > 0}, reverse=True):
        if sum(h >= chips for h in hosts) >= num_workers:
            return int(chips)
    return int(max(hosts))


def workers_this_machine_holds(resource: str, num_workers: int, offer: ClusterOffer) -> int:
    """How many workers asking for ``resource`` fit the accelerators of this machine (a GPU each;
    one TPU host under SPMD): ``num_workers`` when they all do, or on a cluster, which may grow."""
    if not offer.this_machine or not resource or not offer.up(resource):
        return num_workers
    room = int(offer.up(resource)) if resource == "GPU" else len(offer.nodes)
    return max(1, min(num_workers, room))


# ------------------------------------------------------------------ fitting
@dataclass(frozen=True)
class Fit:
    """``now``: starts at once; ``busy``: waits for resources other work holds; ``later``: waits for
    the autoscaler to start nodes; ``never``: cannot run on this cluster."""

    verdict: str
    message: str


def judge_fit(bundles: Sequence[Bundle], offer: ClusterOffer, what: str, advice: str = "") -> Fit:
    """Compare a run's demand (one bundle per worker) with the cluster. ``advice``: what to change
    when it can never fit, if the caller knows better than :func:`remedy`."""
    need = total(bundles)
    if pack(bundles, offer.nodes):
        if all(offer.available.get(k, 0.0) + 1e-9 >= v for k, v in need.items()):
            return Fit("now", "")
        free = {k: v for k, v in offer.available.items() if k in need}
        return Fit("busy", f"waiting for {describe(need)} held by other work (free now: {describe(free)})")
    if offer.node_types and pack(bundles, offer.capacities(len(bundles))):
        return Fit("later", f"{what} ({describe(need)}) wait for the autoscaler to start nodes")
    return Fit("never", never_message(bundles, offer, what, advice))


def never_message(bundles: Sequence[Bundle], offer: ClusterOffer, what: str, advice: str) -> str:
    need, have = total(bundles), total(offer.nodes)
    per_worker = f" ({describe(bundles[0])} each)" if len(bundles) > 1 and offer.node_types else ""
    if offer.node_types:
        where = f"the cluster has {offer.inventory()}"
    else:
        where = f"the cluster has {describe(have)} on {len(offer.nodes)} node(s)"
    short = [k for k, v in need.items() if have.get(k, 0.0) + 1e-9 < v]
    if short or offer.node_types:
        return f"{what} needs {describe(need)}{per_worker} but {where}; {advice or remedy(bundles, offer)}"
    largest = {key: max((n.get(key, 0.0) for n in offer.nodes), default=0.0) for key in need}
    return (
        f"{what} needs {describe(need)}: the cluster's {len(offer.nodes)} node(s) have that in all but no "
        f"worker's share fits on one node (the largest node: {describe(largest)}); "
        f"{advice or remedy(bundles, offer)}"
    )


def remedy(bundles: Sequence[Bundle], offer: ClusterOffer) -> str:
    """What to change so that the run fits: fewer workers when some fit, else the resource that no
    node holds enough of, named with the setting that asks for it."""
    nodes = offer.capacities()
    fitting = max((k for k in range(1, len(bundles)) if pack(list(bundles[:k]), nodes)), default=0)
    if fitting:
        return f"{fitting} worker(s) fit: set scaling.num_workers={fitting} (the global batch stays the same)"
    bundle = bundles[0]
    for resource in sorted(bundle, key=lambda k: (k not in ("TPU", "GPU"), k)):
        largest = max((n.get(resource, 0.0) for n in nodes), default=0.0)
        if bundle[resource] > largest + 1e-9:
            return lacking(resource, bundle[resource], largest)
    return "no node holds one worker's share: ask for less per worker (scaling.resources_per_worker)"


def lacking(resource: str, asked: float, largest: float) -> str:
    if resource == "GPU" and not largest:
        return "the cluster has no GPU: use scaling.runtime=auto (or cpu)"
    if resource == "TPU" and not largest:
        return "the cluster has no TPU: use scaling.runtime=auto (or cpu), or start Ray on the TPU hosts"
    if resource == "CPU":
        return f"no node has {asked:g} CPU: use a smaller scaling.cpus_per_worker (at most {largest:g}, the largest's)"
    if resource in ("GPU", "TPU"):
        return f"no node has {asked:g} {resource}: ask for at most {largest:g} per worker (the largest node's)"
    return f"remove {resource} from scaling.resources_per_worker or add nodes that have it"


def pack(bundles: Sequence[Bundle], capacities: Sequence[Mapping[str, float]]) -> bool:
    """Whether ``bundles`` fit on the nodes' ``capacities`` (first fit, largest bundles first)."""
    free = [dict(node) for node in capacities]
    for bundle in sorted(bundles, key=lambda b: sorted(b.items()), reverse=True):
        node = next((n for n in free if all(n.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())), None)
        if node is None:
            return False
        for key, value in bundle.items():
            node[key] = node.get(key, 0.0) - value
    return True


def total(bundles: Sequence[Mapping[str, float]]) -> Bundle:
    summed: Bundle = {}
    for bundle in bundles:
        for key, value in bundle.items():
            summed[key] = summed.get(key, 0.0) + value
    return summed


def describe(bundle: Mapping[str, float]) -> str:
    shown = {k: v for k, v in bundle.items() if k in CHECKED or not k.startswith(("accelerator_type:", "node:"))}
    return ", ".join(f"{value:g} {key}" for key, value in sorted(shown.items()) if value) or "nothing"


def concurrent_fits(trial: Sequence[Bundle], nodes: Sequence[Mapping[str, float]], limit: int = 64) -> int:
    """How many trials with the bundles ``trial`` fit on ``nodes`` at once (at least 1)."""
    count = 1
    while count < limit and pack(list(trial) * (count + 1), nodes):
        count += 1
    return count
