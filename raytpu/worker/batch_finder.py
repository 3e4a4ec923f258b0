"""``loop.auto_find_batch_size``: the largest per-device batch that fits, on every runtime.

Accelerate's ``find_executable_batch_size`` (what Transformers' ``Trainer`` uses) runs an attempt
and backs off when its ``should_reduce_batch_size`` recognises an out-of-memory error, which it
does for CUDA/CPU/XPU/HPU messages only: XLA's ``RESOURCE_EXHAUSTED`` (a device buffer that cannot
be allocated in HBM, or a program that does not fit in HBM at compile time) is translated here into
the one-argument ``RuntimeError`` it recognises. Each step down halves the per-device micro-batch
and doubles ``loop.grad_accum``, so ``data.global_batch_size`` never changes.

One worker retries in-process with a fresh trainer (which resumes from the run's last checkpoint).
Several cannot: an out-of-memory on one rank leaves the others waiting in an all-reduce. The rank
that hits it records the smaller batch in the run folder (:data:`RECORD`) and fails the attempt
(:class:`BatchReduced`); the group restarts (Ray Train's ``FailureConfig``, or ``raytpu train
--local``) and every rank starts from the smallest batch any rank recorded. A resumed run reads the
same record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from raytpu.config import Config
from raytpu.config.batching import BatchPlan
from raytpu.config.plan import Plan
from raytpu.records.batches import read_record, record
from raytpu.storage.run_folder import RunFolder

if TYPE_CHECKING:
    from raytpu.runtime.base import Runtime

T = TypeVar("T")

#: what an XLA out-of-memory error says beside ``RESOURCE_EXHAUSTED`` (lower case); other
#: exhausted resources (gRPC message sizes, files, VMEM tiling) are not a batch size problem
XLA_OOM_WORDS = ("hbm", "attempting to allocate", "attempting to reserve", "error allocating device buffer")


class BatchReduced(RuntimeError):
    """This attempt of a multi-worker run ended so that the group restarts with a smaller batch."""


class NoBatchFits(RuntimeError):
    """Out of memory at one sample per device: there is no smaller batch to try."""


def reduction_message(failed_at: int, plan: BatchPlan, devices: int) -> str:
    return f"auto_find_batch_size: out of memory at {failed_at} per device; now {plan.describe(devices)}"


# ----------------------------------------------------------------- errors
def is_xla_out_of_memory(text: str) -> bool:
    """XLA's runtime (``RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate
    1.00G ... (0x0x0_HBM0)``) and compile-time (``RESOURCE_EXHAUSTED: XLA:TPU compile permanent
    error. Ran out of memory in memory space hbm ...``) out-of-memory messages, and older runtimes'
    ``Resource exhausted: Attempting to reserve ...``."""
    lowered = text.lower()
    if "resource_exhausted" not in lowered and "resource exhausted" not in lowered:
        return False
    return any(word in lowered for word in XLA_OOM_WORDS)


def as_out_of_memory(exc: BaseException) -> BaseException:
    """An XLA out-of-memory error as Accelerate's finder recognises one (a one-argument
    ``RuntimeError`` with " out of memory."); any other error is returned untouched."""
    text = str(exc)
    if not is_xla_out_of_memory(text):
        return exc
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return RuntimeError(f"XLA device out of memory. {first}")


# ----------------------------------------------------------------- record


def agree(batch: BatchPlan, failed_at: int, world_size: int) -> tuple[BatchPlan, int]:
    """The smallest per-device batch any rank knows of (a run folder that is not shared between
    hosts holds a record only where a rank ran out of memory)."""
    import torch.distributed as dist

    if world_size == 1 or not dist.is_initialized():
        return batch, failed_at
    gathered: list[tuple[int, int]] = [(0, 0)] * world_size
    dist.all_gather_object(gathered, (batch.grad_accum, failed_at))
    grad_accum, failed_at = max(gathered)
    return replace(batch, grad_accum=grad_accum), failed_at


# ----------------------------------------------------------------- finder
class BatchFinder:
    """One worker's search: the starting batch agreed by every rank, then Accelerate's finder. Each
    attempt trains with the config of a new plan, made by the one plan function from the user's
    config with the batch's accumulation steps; the run's plan is never changed (the record and the
    checkpoints' ``meta.json`` say what ran)."""

    def __init__(self, base: Plan, runtime: Runtime, run_dir: RunFolder) -> None:
        self.base, self.runtime, self.run_dir = base, runtime, run_dir
        self.devices = runtime.local_devices
        configured = base.batch
        found = read_record(run_dir, configured, self.devices) or (configured, 0)
        self.plan, failed_at = agree(*found, runtime.world_size)
        if self.plan != configured:
            self._announce(reduction_message(failed_at, self.plan, self.devices))

    def config(self) -> Config:
        """The config of the current batch: its accumulation steps (and per-device batch, when given)."""
        values: dict[str, int] = {"loop.grad_accum": self.plan.grad_accum}
        if self.base.asked.data.per_device_train_batch_size:
            values["data.per_device_train_batch_size"] = self.plan.per_device(self.devices)
        return self.base.remade(values).config

    def find(self, fit: Callable[[Config], T]) -> T:
        from accelerate.utils import find_executable_batch_size  # after the runtime set USE_TORCH_XLA

        def attempt(per_device: int) -> T:
            try:
                return fit(self.config())
            except Exception as exc:
                translated = as_out_of_memory(exc)
                if translated is not exc:
                    raise translated from exc
                if self._reduced_elsewhere():
                    raise BatchReduced("auto_find_batch_size: another rank ran out of memory; restarting") from exc
                raise

        try:
            return find_executable_batch_size(attempt, self.plan.per_device(self.devices), self._reduce)()
        except RuntimeError as exc:
            if "No executable batch size found" not in str(exc):
                raise
            raise NoBatchFits(
                f"auto_find_batch_size: out of memory at 1 sample per device (global batch "
                f"{self.plan.global_batch}); nothing smaller to try: lower data.global_batch_size, use bf16, "
                "or shard the model (sharding.mesh.fsdp)"
            ) from None

    def _reduce(self) -> int:
        """Accelerate's ``reduce_batch_size_fn``: the next plan, recorded; 0 when there is none."""
        smaller = self.plan.smaller(self.devices)
        if smaller is None:
            return 0
        failed_at, self.plan = self.plan.per_device(self.devices), smaller
        record(self.run_dir, smaller, self.devices, failed_at)
        message = reduction_message(failed_at, smaller, self.devices)
        if self.runtime.world_size > 1:
            raise BatchReduced(f"{message}; restarting the worker group")
        self._announce(message)
        return smaller.per_device(self.devices)

    def _reduced_elsewhere(self) -> bool:
        """A multi-worker attempt that failed because a peer stepped down (its collective broke)."""
        if self.runtime.world_size == 1:
            return False
        return read_record(self.run_dir, self.plan, self.devices) is not None

    def _announce(self, message: str) -> None:
        if self.runtime.is_main:
            print(f"raytpu: {message}", flush=True)


def fit_finding_batch(plan: Plan, runtime: Runtime, run_dir: RunFolder, fit: Callable[[Config], T]) -> T:
    """``fit(plan.config)``, through the batch finder when ``loop.auto_find_batch_size`` is on."""
    if not plan.config.loop.auto_find_batch_size:
        return fit(plan.config)
    return BatchFinder(plan, runtime, run_dir).find(fit)
