"""A run over several TPU slices (multislice): the slices' hosts reach each other over the
data-center network (DCN), and libtpu joins them into one program once every host has the
coordinator's environment: ``MEGASCALE_COORDINATOR_ADDRESS`` (the first slice's first host),
``MEGASCALE_PORT``, ``MEGASCALE_NUM_SLICES`` and its ``MEGASCALE_SLICE_ID``, as Ray's own helper
(``ray.util.tpu.get_tpu_coordinator_env_vars``) writes them.

The mesh is then a hybrid one (torch_xla's ``HybridMesh``): the ``data`` axis across the slices,
each slice one replica, whose gradients alone cross the DCN once a step; ``fsdp`` and ``tensor``
within each slice, over its chips' interconnect (ICI).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from raytpu.errors import ConfigError
from raytpu.parallel.mesh import MeshShape, resolve_mesh

#: one worker's host as the slices see it: its slice's name, its TPU worker id there, its address
Host = tuple[str, int, str]


def multislice_env(hosts: Sequence[Host]) -> list[dict[str, str]]:
    """Each worker's multislice environment, in rank order (``hosts``: each rank's host). The
    slices are numbered in the order of their lowest rank (rank 0's slice is slice 0), and the
    coordinator is slice 0's host of TPU worker id 0. Workers of one slice get nothing."""
    from ray.util.tpu import get_tpu_coordinator_env_vars

    names = list(dict.fromkeys(name for name, _, _ in hosts))
    if len(names) < 2:
        return [{} for _ in hosts]
    coordinator = min((worker_id, address) for name, worker_id, address in hosts if name == names[0])[1]
    return [get_tpu_coordinator_env_vars(coordinator, len(names), names.index(name)) for name, _, _ in hosts]


def slices_here() -> int:
    """The slices this worker's program spans (1 without a multislice environment)."""
    return int(os.environ.get("MEGASCALE_NUM_SLICES") or 1)


def slice_mesh(devices: int, slices: int, data: int, fsdp: int, tensor: int) -> tuple[MeshShape, tuple, tuple]:
    """The mesh over ``slices`` slices of ``devices`` devices in all: the whole mesh, and the
    ``HybridMesh`` shapes within a slice (ICI) and across slices (DCN). The ``data`` axis spans the
    slices: -1 gives each slice the replicas its devices leave, a number is the whole run's replicas
    and must be a multiple of the slices."""
    if devices % slices:
        raise ConfigError(f"{devices} devices do not split over {slices} slices")
    if data != -1 and data % slices:
        raise ConfigError(
            f"sharding.mesh.data={data}: the data axis spans the {slices} slices (each slice one replica or "
            f"more): give it a multiple of {slices}, or -1"
        )
    within = resolve_mesh(devices // slices, -1 if data == -1 else data // slices, fsdp, tensor, "devices of a slice")
    whole = MeshShape(within.data * slices, within.fsdp, within.tensor)
    return whole, within.shape, (slices, 1, 1)
