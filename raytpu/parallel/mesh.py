"""The device mesh's three axes and their arithmetic: ``data`` (replicas of the model, each with
its share of the batch), ``fsdp`` (devices each parameter, gradient and optimizer state is sharded
over, each with its share of the batch too) and ``tensor`` (devices each layer's matrix products are
split over, Megatron-style: they all see the same batch). The axes multiply to the devices: the
workers on cpu and cuda (a worker a device), every device of the SPMD program on xla.

``sharding.mesh`` names them as torchprime's ``ici_mesh`` does; -1 on an axis is "the devices left".
"""

from __future__ import annotations

from dataclasses import dataclass

from raytpu.errors import ConfigError

#: the axes in mesh order: the outermost (least communication) first
AXES = ("data", "fsdp", "tensor")


@dataclass(frozen=True)
class MeshShape:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def replicas(self) -> int:
        """The batch's shares: every device of a tensor group sees the same samples."""
        return self.data * self.fsdp

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.data, self.fsdp, self.tensor

    def describe(self) -> str:
        return " x ".join(f"{axis} {size}" for axis, size in zip(AXES, self.shape, strict=True))


def resolve_mesh(devices: int, data: int, fsdp: int, tensor: int, where: str) -> MeshShape:
    """The mesh over ``devices`` (``where`` says what they are, for the error): -1 on an axis takes
    the devices the others leave, ``fsdp`` before ``data`` (``--fsdp full_shard`` leaves ``data`` at
    -1 and puts every device on ``fsdp``). A ConfigError when the axes do not multiply to ``devices``."""
    check_axes(data, fsdp, tensor)
    if tensor == -1:
        tensor = devices // max(data, 1) // max(fsdp, 1)
    if fsdp == -1:
        fsdp = devices // max(data, 1) // tensor
    if data == -1:
        data = devices // (fsdp * tensor)
    shape = MeshShape(data, fsdp, tensor)
    if min(shape.shape) < 1 or shape.devices != devices:
        asked = " x ".join(f"{axis}={size}" for axis, size in zip(AXES, shape.shape, strict=True))
        raise ConfigError(
            f"sharding.mesh {asked} makes {max(shape.devices, 0)} devices, not the {devices} {where}: give axes "
            f"whose product is {devices} (-1 on one axis takes the devices the others leave)"
        )
    return shape


def check_axes(data: int, fsdp: int, tensor: int) -> None:
    """Each axis at least 1, or -1 ("the rest") on at most one of them besides ``data``'s default."""
    values = dict(zip(AXES, (data, fsdp, tensor), strict=True))
    wrong = [f"sharding.mesh.{axis}={size}" for axis, size in values.items() if size == 0 or size < -1]
    if wrong:
        raise ConfigError(f"{', '.join(wrong)}: each mesh axis is at least 1, or -1 for the devices the others leave")
    if fsdp == -1 and tensor == -1:
        raise ConfigError("sharding.mesh.fsdp and sharding.mesh.tensor are both -1: give one of them a size")
