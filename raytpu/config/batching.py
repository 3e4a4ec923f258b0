"""Batch arithmetic, in one place: how a global batch splits over workers, accumulation steps and
devices, and whether a split of the data is large enough for it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytpu.errors import ConfigError

if TYPE_CHECKING:
    from raytpu.config.schema import Config


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch is split: over ``workers`` data-parallel workers and ``grad_accum``
    micro-steps; a worker splits its share again over its devices (a TPU host's chips)."""

    global_batch: int
    workers: int
    grad_accum: int = 1
    eval_batch: int = 0  # the global eval batch (0 = global_batch)

    def __post_init__(self) -> None:
        share = self.workers * self.grad_accum
        if self.global_batch % share:
            raise ConfigError(
                f"data.global_batch_size={self.global_batch} is not divisible by {self.workers} data-parallel "
                f"workers x {self.grad_accum} accumulation steps; use a multiple of {share}"
            )

    @classmethod
    def of(cls, cfg: Config) -> BatchPlan:
        return cls(cfg.data.global_batch_size, reading_workers(cfg), cfg.loop.grad_accum, cfg.data.eval_batch_size)

    @property
    def per_worker(self) -> int:
        """Samples each worker takes per micro-step."""
        return self.global_batch // (self.workers * self.grad_accum)

    @property
    def eval_per_worker(self) -> int:
        return max(1, (self.eval_batch or self.global_batch) // self.workers)

    def per_device(self, devices: int) -> int:
        """Samples per device when a worker drives ``devices`` of them (SPMD over a host's chips)."""
        if self.per_worker % devices:
            raise ConfigError(
                f"data.global_batch_size={self.global_batch} gives {self.per_worker} samples per worker, "
                f"not divisible by its {devices} devices"
            )
        return self.per_worker // devices

    def smaller(self, devices: int) -> BatchPlan | None:
        """Half the per-device batch with twice the accumulation steps (an odd batch is divided by its
        smallest factor instead, so the global batch stays whole); None at one sample per device."""
        per_device = self.per_device(devices)
        factor = next((f for f in range(2, per_device + 1) if per_device % f == 0), None)
        return None if factor is None else dataclasses.replace(self, grad_accum=self.grad_accum * factor)

    def describe(self, devices: int = 1) -> str:
        accum = f" x {self.grad_accum} accumulation steps" if self.grad_accum > 1 else ""
        return f"{self.per_device(devices)} per device{accum} (global batch {self.global_batch})"

    def check_split(self, split: str, samples: int, where: str) -> None:
        """Train: every worker gets at least one optimizer step an epoch; eval: a sample per worker."""
        if split == "train":
            if (samples // self.workers) // self.per_worker < self.grad_accum:
                raise ConfigError(
                    f"the train split of {where} has {samples} samples, fewer than one step of "
                    f"data.global_batch_size={self.global_batch} over {self.workers} worker(s); "
                    "lower data.global_batch_size or add data"
                )
        elif samples < self.workers:
            raise ConfigError(
                f"the {split} split of {where} has {samples} samples, fewer than the {self.workers} workers"
            )

    def check_splits(self, sizes: Iterable[tuple[str, int]], where: str) -> None:
        """:meth:`check_split` for each split the driver counted."""
        for split, samples in sizes:
            self.check_split(split, samples, where)

    def sized(self, workers: int, devices: int = 1) -> BatchPlan:
        """This global batch over ``workers`` workers (another size of an elastic run): each worker's
        micro-batch at most this plan's (what fits its memory), with the fewest accumulation steps
        that split it evenly (over ``devices`` per worker too); a ValueError when none does."""
        share, rest = divmod(self.global_batch, workers)
        for accum in range(1, share + 1) if not rest else ():
            micro, left = divmod(share, accum)
            if not left and micro <= self.per_worker and not micro % devices:
                return dataclasses.replace(self, workers=workers, grad_accum=accum)
        raise ValueError(f"{self.global_batch} does not split over {workers} worker(s)")

    def steps_per_epoch(self, samples: int) -> int:
        """Optimizer steps in an epoch of ``samples`` train samples (``drop_last`` on every worker)."""
        return (samples // self.workers) // self.per_worker // self.grad_accum


def reading_workers(cfg: Config) -> int:
    """The workers that read samples of their own: where the runtime's mesh is over its workers (cpu,
    cuda), a tensor group's workers read the same samples; on xla each worker feeds its devices,
    whatever the mesh within them (and before ``auto`` has picked a runtime, every worker counts)."""
    from raytpu.parallel.mesh import resolve_mesh
    from raytpu.runtime.kinds import registered

    mesh, workers = cfg.sharding.mesh, cfg.scaling.num_workers
    kind = registered().get(cfg.scaling.runtime)
    if mesh.tensor == 1 or kind is None or not kind.mesh_over_workers:
        return workers
    fsdp = mesh.fsdp if mesh.tensor == -1 else -1
    return resolve_mesh(workers, 1, fsdp, mesh.tensor, "workers (scaling.num_workers)").replicas


def elastic_plans(cfg: Config, sizes: Sequence[int], devices: int = 1) -> dict[int, BatchPlan]:
    """The batch of each size of an elastic run, from its plan at the largest size: the global batch
    kept, accumulation absorbing the change. A size that cannot hold it is refused in one line
    naming the sizes and what to change."""
    global_batch, plans, workers = cfg.data.global_batch_size, {}, max(sizes)
    try:
        largest = BatchPlan.of(
            dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, num_workers=max(sizes)))
        )
        for workers in sizes:
            plans[workers] = largest.sized(workers, devices)
    except (ValueError, ConfigError):
        steps = math.lcm(*sizes) * devices * cfg.loop.grad_accum
        suggestion = -(-global_batch // steps) * steps
        raise ConfigError(
            f"data.global_batch_size={global_batch} does not split over {workers} workers, a size of "
            f"scaling.num_workers={min(sizes)}:{max(sizes)} (each size holds the whole global batch, "
            f"accumulation absorbing the change): use data.global_batch_size={suggestion} (a multiple of "
            f"{steps}), or a range whose sizes all divide {global_batch}"
        ) from None
    return plans
