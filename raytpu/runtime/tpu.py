"""TPU slice arithmetic and the torch_xla PJRT multi-process environment, as pure functions.

Nothing here imports torch_xla or touches a device, so the Ray driver can plan a
TPU run and tests can check it on any machine.

Facts mirrored from Ray 2.60 (``ray._private.accelerators.tpu``, ``ray.util.tpu``)
and torch_xla 2.9 (``torch_xla/_internal/tpu.py``):

* A pod type counts TensorCores: ``v4-16`` is 8 chips (2 cores per chip on v4 and
  v5p, 1 on v5e and v6e). v5e is spelt ``v5litepod`` in pod types and
  ``TPU-V5LITEPOD`` in Ray's ``accelerator_type`` resource.
* Hosts have 4 chips, except the single-host v5e / v6e topologies 1x1, 2x2 and
  2x4, whose one host has all 1, 4 or 8 chips.
* With one process per chip, torch_xla's process bounds are the slice's chip grid
  (host bounds times chips-per-host bounds), the task id of a process is
  ``host_index * processes_per_host + local_rank``, every host serves the same
  ports ``base_port + local_rank``, and a single-host slice uses ``localhost``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from math import prod

LAYOUTS = ("spmd", "multiprocess")
DEFAULT_PJRT_PORT = 8476
DEFAULT_CHIPS_PER_HOST = 4
# Older names of the bounds variables; Ray sets them for 1- and 2-chip workers. They must not contradict ours.
SUPERSEDED_BOUNDS_VARS = ("TPU_HOST_BOUNDS", "TPU_CHIPS_PER_HOST_BOUNDS")
# Chip grid of one host by its chip count (x, y, z), as GCP's TPU metadata and Ray give it.
_HOST_CHIP_BOUNDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}

_TOPOLOGIES_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}
_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SMALL_3D = frozenset({"2x2x1", "2x2x2", "2x2x4", "2x4x4"})


@dataclass(frozen=True)
class Generation:
    """One TPU generation: how its topologies, hosts and pod types are counted."""

    name: str  # spelling in pod types: v4, v5litepod, v5p, v6e
    ray_type: str  # Ray's accelerator_type resource suffix: TPU-V4, TPU-V5LITEPOD, ...
    cores_per_chip: int  # TensorCores per chip (what pod types count)
    topology_dims: int  # 3 for v4 / v5p ("2x2x2"), 2 for v5e / v6e ("2x4")
    single_host_topologies: frozenset[str]  # topologies served by one host holding every chip
    standard_topologies: Mapping[int, str]  # chip count -> GCP's topology for that pod type
    extra_topologies: frozenset[str] = frozenset()  # further valid topologies (Ray's VALID_TPU_TOPOLOGY)


GENERATIONS: dict[str, Generation] = {
    "v4": Generation("v4", "TPU-V4", 2, 3, frozenset(), _TOPOLOGIES_3D),
    "v5p": Generation("v5p", "TPU-V5P", 2, 3, frozenset(), _TOPOLOGIES_3D),
    "v5litepod": Generation(
        "v5litepod", "TPU-V5LITEPOD", 1, 2, frozenset({"1x1", "2x2", "2x4"}), _TOPOLOGIES_2D, frozenset({"2x8"})
    ),
    "v6e": Generation("v6e", "TPU-V6E", 1, 2, frozenset({"1x1", "2x2", "2x4"}), _TOPOLOGIES_2D, frozenset({"2x8"})),
}
_ALIASES = {"v5e": "v5litepod", "v5lite_pod": "v5litepod", "v5lite": "v5litepod"}


@dataclass(frozen=True)
class SliceSpec:
    """One TPU slice: its generation, chip grid and how the chips are spread over hosts."""

    generation: str
    topology: str
    num_hosts: int
    chips_per_host: int
    cores_per_chip: int

    @property
    def num_chips(self) -> int:
        return self.num_hosts * self.chips_per_host

    @property
    def pod_type(self) -> str:
        """GCP's accelerator type, counting TensorCores: ``v4-16``, ``v5litepod-8``."""
        return f"{self.generation}-{self.num_chips * self.cores_per_chip}"

    @property
    def accelerator_type(self) -> str:
        """Ray's accelerator type, as in ``ScalingConfig(accelerator_type=...)``: ``TPU-V5LITEPOD``."""
        return GENERATIONS[self.generation].ray_type

    @property
    def multi_host(self) -> bool:
        return self.num_hosts > 1


def generation(accelerator_type: str) -> Generation:
    """Look up a generation by any usual spelling: ``v5litepod``, ``v5e``, ``TPU-V5LITEPOD``, ``V5LITE_POD``."""
    key = re.sub(r"^tpu-?", "", accelerator_type.strip().lower())
    key = _ALIASES.get(key, key)
    if key not in GENERATIONS:
        if re.fullmatch(r"v\d+[a-z_]*-\d+", key):
            raise ValueError(f"{accelerator_type!r} is a pod type; use parse_pod_type({accelerator_type!r})")
        known = ", ".join(f"{g.name} ({g.ray_type})" for g in GENERATIONS.values())
        raise ValueError(f"unknown TPU accelerator type {accelerator_type!r}; known: {known}, v5e = v5litepod")
    return GENERATIONS[key]


def parse_topology(topology: str, dims: int | None = None) -> tuple[int, ...]:
    """``"2x2x2"`` -> ``(2, 2, 2)``; ValueError unless it is ``dims`` positive integers joined by ``x``."""
    text = topology.strip().lower()
    if not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)+", text):
        raise ValueError(f"malformed TPU topology {topology!r}: expected chip counts joined by 'x', e.g. 2x4 or 2x2x2")
    shape = tuple(int(d) for d in text.split("x"))
    if dims is not None and len(shape) != dims:
        example = "2x2x2" if dims == 3 else "2x4"
        raise ValueError(f"TPU topology {topology!r} must have {dims} dimensions for this generation, e.g. {example}")
    return shape


def _valid_topology(gen: Generation, topology: str) -> bool:
    if topology in gen.standard_topologies.values() or topology in gen.extra_topologies:
        return True
    shape = parse_topology(topology)
    return gen.topology_dims == 3 and (topology in _SMALL_3D or all(d % 4 == 0 for d in shape))


def chips_per_host(gen: Generation, topology: str) -> int:
    """Chips on each host: all of them for single-host v5e / v6e topologies, else 4 (as Ray counts them)."""
    if topology in gen.single_host_topologies:
        return prod(parse_topology(topology))
    return DEFAULT_CHIPS_PER_HOST


def slice_spec(accelerator_type: str, topology: str) -> SliceSpec:
    """The slice of ``accelerator_type`` (``TPU-V5LITEPOD``, ``v4``, ...) with chip grid ``topology``."""
    gen = generation(accelerator_type)
    topology = topology.strip().lower()
    parse_topology(topology, gen.topology_dims)
    if not _valid_topology(gen, topology):
        known = set(gen.standard_topologies.values()) | gen.extra_topologies
        valid = sorted(known, key=lambda t: prod(parse_topology(t)))
        raise ValueError(f"topology {topology!r} is not a {gen.name} slice; valid: {', '.join(valid)}")
    per_host = chips_per_host(gen, topology)
    return SliceSpec(gen.name, topology, prod(parse_topology(topology)) // per_host, per_host, gen.cores_per_chip)


def parse_pod_type(pod_type: str) -> SliceSpec:
    """``"v4-16"`` (16 TensorCores = 8 chips, 2x2x2) or ``"v5litepod-8"`` (8 chips, 2x4) -> its SliceSpec."""
    match = re.fullmatch(r"(?:tpu-?)?(v\d+[a-z_]*)-(\d+)", pod_type.strip().lower())
    if not match:
        raise ValueError(f"malformed TPU pod type {pod_type!r}: expected <generation>-<cores>, e.g. v4-16, v5litepod-8")
    gen = generation(match.group(1))
    cores = int(match.group(2))
    if cores == 0 or cores % gen.cores_per_chip:
        raise ValueError(f"{pod_type!r}: a {gen.name} pod type counts {gen.cores_per_chip} cores per chip")
    chips = cores // gen.cores_per_chip
    if chips not in gen.standard_topologies:
        sizes = ", ".join(f"{gen.name}-{n * gen.cores_per_chip}" for n in gen.standard_topologies)
        raise ValueError(f"no standard topology for {pod_type!r}; known sizes: {sizes} (or give slice_spec a topology)")
    return slice_spec(gen.name, gen.standard_topologies[chips])


def workers_for_layout(spec: SliceSpec, layout: str) -> tuple[int, dict[str, float]]:
    """``(num_workers, resources_per_worker)`` for a layout: one worker per host (spmd) or per chip (multiprocess)."""
    if layout == "spmd":
        return spec.num_hosts, {"TPU": spec.chips_per_host}
    if layout == "multiprocess":
        return spec.num_chips, {"TPU": 1}
    raise ValueError(f"unknown TPU layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def check_num_workers(spec: SliceSpec, layout: str, num_workers: int, slices: int = 1) -> None:
    """Raise a one-line ValueError naming the right worker count when ``num_workers`` is not one
    worker per host (spmd) or chip (multiprocess) of ``slices`` slices."""
    per_slice, _ = workers_for_layout(spec, layout)
    expected = per_slice * slices
    if num_workers != expected:
        unit = "host" if layout == "spmd" else "chip"
        of = f" of {slices} slices" if slices > 1 else ""
        raise ValueError(
            f"{spec.pod_type} ({spec.num_hosts} host(s) x {spec.chips_per_host} chips) with layout '{layout}' "
            f"needs num_workers={expected} (one per {unit}{of}), got {num_workers}"
        )


def _bounds3(topology: str) -> tuple[int, int, int]:
    shape = parse_topology(topology)
    if len(shape) > 3:
        raise ValueError(f"TPU topology {topology!r} has more than 3 dimensions")
    x, y, z = shape + (1,) * (3 - len(shape))
    return x, y, z


def _process_bounds(chips_per_host: int, num_hosts: int, topology: str | None) -> str:
    if topology is not None:
        bounds = _bounds3(topology)
        if prod(bounds) != chips_per_host * num_hosts:
            raise ValueError(
                f"topology {topology!r} has {prod(bounds)} chips but {num_hosts} host(s) x {chips_per_host} "
                "processes were given"
            )
    elif num_hosts == 1 and chips_per_host in _HOST_CHIP_BOUNDS:
        bounds = _HOST_CHIP_BOUNDS[chips_per_host]
    elif num_hosts == 1:
        raise ValueError(f"a host has 1, 2, 4 or 8 TPU chips, not {chips_per_host}")
    else:
        raise ValueError("a multi-host slice needs topology= (e.g. SliceSpec.topology): host count alone is ambiguous")
    return ",".join(str(d) for d in bounds)


def _check_ranks(world_rank: int, local_rank: int, chips_per_host: int, host_index: int, num_hosts: int) -> None:
    if chips_per_host < 1 or not 0 <= local_rank < chips_per_host:
        raise ValueError(f"local_rank {local_rank} is outside 0..{chips_per_host - 1} ({chips_per_host} per host)")
    if not 0 <= host_index < num_hosts:
        raise ValueError(f"host_index {host_index} is outside 0..{num_hosts - 1} ({num_hosts} host address(es))")
    task_id = host_index * chips_per_host + local_rank
    if world_rank != task_id:
        raise ValueError(
            f"world rank {world_rank} is host {host_index} local rank {local_rank}, which torch_xla numbers {task_id}: "
            "list host_addresses in the order of the ranks they hold"
        )


def pjrt_env_for_process(
    world_rank: int,
    local_rank: int,
    chips_per_host: int,
    host_index: int,
    host_addresses: list[str],
    port: int = DEFAULT_PJRT_PORT,
    *,
    topology: str | None = None,
) -> dict[str, str]:
    """torch_xla's PJRT environment for one process driving one chip (the multiprocess layout).

    The variables and formats are those torch_xla 2.9 sets in ``initialize_multiprocess`` /
    ``configure_topology`` for ``xmp.spawn`` on a TPU. ``host_addresses`` lists every host of
    the slice, host ``h`` holding world ranks ``h * chips_per_host ...``; ``topology`` (the
    slice's chip grid, e.g. ``"2x2x2"``) is needed when there is more than one host. Apply
    the result with :func:`apply_env` before torch_xla is imported: it replaces the
    ``TPU_VISIBLE_CHIPS`` Ray set for the worker's ``{"TPU": 1}`` (or start the workers with
    ``RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS=1``). Chip ``local_rank`` is driven by the
    process of that local rank, as in ``xmp.spawn``, so each host must be used whole.
    """
    if not host_addresses:
        raise ValueError("host_addresses is empty: list the address of every host of the slice")
    _check_ranks(world_rank, local_rank, chips_per_host, host_index, len(host_addresses))
    hosts = host_addresses if len(host_addresses) > 1 else ["localhost"]
    ports = [port + i for i in range(chips_per_host)]
    return {
        "PJRT_DEVICE": "TPU",
        "PJRT_LOCAL_PROCESS_RANK": str(local_rank),
        "PJRT_LOCAL_PROCESS_COUNT": str(chips_per_host),
        "TPU_VISIBLE_CHIPS": str(local_rank),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_BOUNDS": _process_bounds(chips_per_host, len(host_addresses), topology),
        "TPU_PROCESS_ADDRESSES": ",".join(f"{host}:{p}" for host in hosts for p in ports),
        "TPU_PROCESS_PORT": str(ports[local_rank]),
        "CLOUD_TPU_TASK_ID": str(world_rank),
    }


def chip_process_env(
    world_rank: int, placements: Sequence[tuple[int, str]], spec: SliceSpec, port: int = DEFAULT_PJRT_PORT
) -> dict[str, str]:
    """:func:`pjrt_env_for_process` for Ray world rank ``world_rank`` of a per-chip run, numbered as torch_xla does.

    ``placements[r]`` is ``(tpu_worker_id, host_address)`` of world rank ``r``, gathered from every
    worker. Ray Train 2.60 keeps a slice's per-chip workers together by host but orders the hosts as
    it reserved them, not by TPU worker id (``tests/test_multinode.py`` sees rank 0 on worker
    1), so the task id is what ``xmp.spawn`` would give: ``worker_id * chips_per_host + local rank``,
    the local rank being the position of the rank among its host's ranks, and the hosts are listed
    by worker id.
    """
    if len(placements) != spec.num_chips:
        raise ValueError(f"{spec.pod_type} has {spec.num_chips} chips but {len(placements)} chip processes were given")
    ranks_of: dict[int, list[int]] = {}
    address_of: dict[int, str] = {}
    for rank, (worker_id, address) in enumerate(placements):
        ranks_of.setdefault(worker_id, []).append(rank)
        if address_of.setdefault(worker_id, address) != address:
            raise ValueError(f"TPU worker {worker_id} has two addresses: {address_of[worker_id]} and {address}")
    counts = {worker: len(ranks) for worker, ranks in sorted(ranks_of.items())}
    if counts != {worker: spec.chips_per_host for worker in range(spec.num_hosts)}:
        raise ValueError(
            f"{spec.pod_type} needs {spec.chips_per_host} processes on each TPU worker 0..{spec.num_hosts - 1}; "
            f"processes per worker id: {counts}"
        )
    worker_id = placements[world_rank][0]
    local_rank = ranks_of[worker_id].index(world_rank)
    hosts = [address_of[worker] for worker in range(spec.num_hosts)]
    task_id = worker_id * spec.chips_per_host + local_rank
    per_host = spec.chips_per_host
    return pjrt_env_for_process(task_id, local_rank, per_host, worker_id, hosts, port, topology=spec.topology)


def tpu_worker_id(labels: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> int:
    """This host's index in its slice: Ray's node label ``ray.io/tpu-worker-id``, else ``TPU_WORKER_ID``."""
    value = labels.get("ray.io/tpu-worker-id") or environ.get("TPU_WORKER_ID")
    if value is None or not str(value).isdigit():
        raise ValueError(
            "cannot tell this host's TPU worker id: the Ray node has no ray.io/tpu-worker-id label and "
            "TPU_WORKER_ID is not set (start Ray on the TPU VM itself, or set TPU_WORKER_ID)"
        )
    return int(value)


def apply_env(env: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Write ``env`` into ``environ`` (default ``os.environ``), overriding what Ray set.

    When process bounds are set, the older ``TPU_HOST_BOUNDS`` / ``TPU_CHIPS_PER_HOST_BOUNDS``
    (which Ray sets for 1- and 2-chip workers) are removed so that they cannot contradict them.
    """
    target = os.environ if environ is None else environ
    if "TPU_PROCESS_BOUNDS" in env:
        for name in SUPERSEDED_BOUNDS_VARS:
            target.pop(name, None)
    target.update(env)


# ------------------------------------------------------------------ TPU devices: peaks, and a TPU VM or not
#: TPU generation (as spelt in pod types, v5e as v5e) -> bf16 FLOP/s per chip
TPU_PEAK_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}

# device kinds and pod types: "TPU v5 lite", "v5litepod-8", "TPU v6 lite", "v6e-8", "TPU v4", "v5p-16"
_TPU_ALIASES = {"v5lite": "v5e", "v6lite": "v6e", "v5": "v5p"}


def tpu_generation(name: str) -> str:
    """``v4``, ``v5e``, ``v5p`` or ``v6e`` (or the unknown name, normalised) from an accelerator type
    (``v5litepod-8``) or a PJRT device kind (``TPU v5 lite``)."""
    key = re.sub(r"^tpu[\s_-]*", "", name.strip().lower())
    key = re.sub(r"-\d+$", "", key)
    key = re.sub(r"[\s_]", "", key).removesuffix("pod")
    return _TPU_ALIASES.get(key, key)


def tpu_peak_flops(name: str) -> float | None:
    """bf16 peak FLOP/s of one chip of the TPU ``name`` (see :func:`tpu_generation`), None if unknown."""
    return TPU_PEAK_FLOPS.get(tpu_generation(name))


def tpu_present() -> bool:
    """A TPU VM, told by its device files or env, without initialising a TPU runtime."""
    if os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or os.environ.get("TPU_ACCELERATOR_TYPE"):
        return True
    return any(os.path.exists(path) for path in ("/dev/accel0", "/dev/vfio/0"))
