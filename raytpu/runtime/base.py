"""The :class:`Runtime` interface (one worker's device, precision and data-parallel plumbing) and
its policies as pure functions (BatchNorm's scope, a GPU's bf16), tested without any device. What
each runtime means on the driver's side is its description: ``raytpu.runtime.kinds``."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raytpu.runtime.profiling import profiler as profiler_for
from raytpu.runtime.profiling import step_mark

#: the first CUDA compute capability with bf16 tensor cores (Ampere)
BF16_CAPABILITY = (8, 0)
#: the first with float8 tensor cores (Ada, Hopper): what ``scaling.precision: fp8`` needs
FLOAT8_CAPABILITY = (8, 9)


def has_bf16(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability computes in bf16 natively. Not
    ``torch.cuda.is_bf16_supported()``, which also says yes where bf16 is only emulated (V100, T4:
    compute capability 7.x), far slower there than fp16 with a gradient scaler."""
    return tuple(capability) >= BF16_CAPABILITY


def local_gpu_has_bf16(device: int | None = None) -> bool:
    """:func:`has_bf16` of this process's GPU (the current one unless ``device`` says)."""
    return has_bf16(torch.cuda.get_device_capability(device))


def has_float8(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has float8 tensor cores."""
    return tuple(capability) >= FLOAT8_CAPABILITY


def check_float8(device: torch.device) -> None:
    """A RuntimeError that says why this worker's GPU cannot run fp8, where it cannot."""
    capability = torch.cuda.get_device_capability(device)
    if not has_float8(capability):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"scaling.precision=fp8 needs float8 tensor cores (compute capability 8.9+) and this worker's "
            f"{name} is {capability[0]}.{capability[1]}: use scaling.precision=bf16"
        )


# ------------------------------------------------------------------ GPUs: their peaks and memory by kind
#: GPU name pattern (matched against ``torch.cuda.get_device_name``, lower case) -> dense bf16
#: FLOP/s; the first match wins, so variants come before their family
GPU_PEAK_FLOPS = [
    (r"\bh100\b.*\bpcie\b", 756e12),
    (r"\bh[12]00\b.*\bnvl\b", 835e12),
    (r"\bh[12]00\b", 989e12),
    (r"\ba100\b", 312e12),
    (r"\ba10g\b", 70e12),
    (r"\bl4\b", 121e12),
]

#: memory of each GPU, by the names Ray gives them (``accelerator_type:<name>``) and by the words
#: of ``torch.cuda.get_device_name`` (``NVIDIA H100 80GB HBM3``), in GB
GPU_MEMORY_GB = {
    "H200": 141,
    "H100": 80,
    "H20": 96,
    "B200": 180,
    "GH200": 96,
    "A100-80G": 80,
    "A100-40G": 40,
    "A100": 40,
    "L40S": 48,
    "L40": 48,
    "L4": 24,
    "A10G": 24,
    "A10": 24,
    "T4": 16,
    "V100": 16,
    "P100": 16,
}

#: GPUs without bf16 (before Ampere), by the names Ray gives them (``accelerator_type:<name>``)
GPUS_WITHOUT_BF16 = frozenset({"K80", "M60", "P4", "P40", "P100", "V100", "T4"})
#: GPUs with float8 tensor cores, by the names Ray gives them
GPUS_WITH_FLOAT8 = frozenset({"L4", "L40", "L40S", "H100", "H200", "H20", "GH200", "B100", "B200", "GB200"})


def gpu_peak_flops(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU ``name`` (``NVIDIA H100 80GB HBM3``), None if unknown."""
    lowered = name.lower()
    return next((peak for pattern, peak in GPU_PEAK_FLOPS if re.search(pattern, lowered)), None)


def memory_of(kind: str) -> float | None:
    """A GPU's memory in GB from its name: the size it states (``NVIDIA H100 80GB HBM3``), else the table."""
    words = kind.replace("-", " ").split()
    for word in words:
        if word.upper().endswith("GB") and word[:-2].isdigit():
            return float(word[:-2])
    if kind in GPU_MEMORY_GB:
        return float(GPU_MEMORY_GB[kind])
    upper = {word.upper() for word in words}
    for name, memory in GPU_MEMORY_GB.items():
        if name in upper:
            return float(memory)
    return None


def device_memory_gb(kinds: set[str] | frozenset[str] | list[str]) -> float | None:
    """The smallest memory of the GPUs named (Ray's names or CUDA's), or None when none is known."""
    found = [memory for memory in (memory_of(kind) for kind in kinds) if memory is not None]
    return min(found) if found else None


def batchnorm_scope(runtime: str, requested: str, spmd: bool, world_size: int) -> str:
    """Where BatchNorm takes its training statistics (``loop.sync_batchnorm``): ``"global"``, the
    whole global batch, or ``"local"``, each worker's slice of it.

    * xla with SPMD: always global (the batch is one sharded tensor; XLA reduces the statistics);
    * xla with one device per worker: local (cross-worker BatchNorm is not offered there);
    * cuda: ``auto`` / ``true`` -> global with ``torch.nn.SyncBatchNorm``; ``false`` -> local;
    * cpu: ``true`` -> global with :class:`~raytpu.runtime.torch_ddp.GlobalBatchNorm` (one gloo
      all-reduce per layer); ``auto`` / ``false`` -> local, the cheaper choice on CPU.

    One worker holding the whole batch is global whatever is asked.
    """
    if runtime == "xla" and spmd:
        return "global"
    if world_size == 1:
        return "global"
    if runtime == "xla":
        if requested == "true":
            raise ValueError(
                "loop.sync_batchnorm=true needs xla.spmd=true on XLA (with one device per worker each "
                "normalises its own slice); or set loop.sync_batchnorm=auto"
            )
        return "local"
    if requested == "true" or (requested == "auto" and runtime == "cuda"):
        return "global"
    return "local"


class RecompileError(RuntimeError):
    """A training step recompiled its XLA graph after warm-up, with ``xla.strict_recompile`` on."""


class Runtime:
    """One worker's device, precision and data-parallel plumbing."""

    name = "base"
    #: steps are traced and compiled (XLA): every step should run the same graph
    static_graph = False
    #: the model is sharded over the workers (FSDP2): every forward is a collective that all ranks run,
    #: and checkpoints are written shard by shard
    sharded = False

    def __init__(self, precision: str, world_size: int, rank: int, local_rank: int) -> None:
        self.precision = precision
        self.world_size = world_size
        self.rank = rank
        self.local_rank = local_rank
        self.device = torch.device("cpu")

    # ------------------------------------------------------------- topology
    @property
    def data_parallel_size(self) -> int:
        """How many shards the dataset is split into (one per worker)."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        return self.rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def local_devices(self) -> int:
        """Devices this worker drives (its share of the batch is split over them)."""
        return 1

    @property
    def pin_memory(self) -> bool:
        """Whether data loaders should pin host memory for copies to this device."""
        return False

    @property
    def fused_optimizer(self) -> bool:
        """Whether Adam and AdamW take PyTorch's fused kernel here (one kernel for every parameter)."""
        return False

    def device_kind(self) -> str:
        """The worker's device as its vendor names it (``NVIDIA H100 80GB HBM3``, ``v5litepod-8``)."""
        return self.device.type

    def on_accelerator(self) -> bool:
        """Whether the worker's device is an accelerator (a GPU, a TPU chip), not a host CPU."""
        return self.device_kind().lower() != "cpu"

    def device_peak_flops(self) -> float | None:
        """Documented dense bf16 peak FLOP/s of one device (its runtime's description says it:
        ``raytpu.runtime.builtin``); None when unknown, and on CPUs, which have no such figure."""
        return None

    def peak_flops(self) -> float | None:
        """Peak FLOP/s of all the devices this worker drives: its share of MFU's denominator."""
        peak = self.device_peak_flops()
        return None if peak is None else peak * self.local_devices

    # --------------------------------------------------------------- model
    def build(self, make: Callable[[], nn.Module]) -> nn.Module:
        """The job's model as ``make`` builds it (its weights: initial, pretrained or loaded after)."""
        return make()

    def prepare_model(
        self, model: nn.Module, find_unused_parameters: bool = False, sync_batchnorm: str = "auto"
    ) -> nn.Module:
        """The model on this worker's device, wrapped for data parallelism; BatchNorm layers take
        their statistics as :func:`batchnorm_scope` says for ``sync_batchnorm``."""
        return model.to(self.device)

    def track_unused_parameters(self, model: nn.Module, unused: bool) -> nn.Module:
        """The model wrapped to look for parameters without gradient exactly when ``unused``
        (DDP: re-wrapped when that changes, at an epoch start)."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model inside the runtime's wrappers (torch.compile's, then the data-parallel one)."""
        model = getattr(model, "_orig_mod", model)
        return getattr(model, "module", model)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16  # fp8: its other layers in bf16
        return torch.autocast(self.device.type, dtype=dtype)

    def compiled_step(self) -> contextlib.AbstractContextManager:
        """Context of one training step (XLA traces it as one graph)."""
        return contextlib.nullcontext()

    def no_sync(self, model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
        """Skip the gradient all-reduce on accumulation micro-steps."""
        if skip and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- step
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float, measure: bool = True
    ) -> torch.Tensor | None:
        """Clip (if ``max_norm``), step, and return the pre-clip gradient norm (a tensor; None when
        neither clipping nor ``measure`` asks for it)."""
        norm = clip_or_measure(params, max_norm, measure)
        optimizer.step()
        return norm

    def mark_step(self) -> None:
        """End of a training step (XLA: cut and run the graph)."""

    def add_step_closure(self, fn: Callable[..., None], args: tuple = ()) -> None:
        """Run ``fn(*args)`` once the step's tensors are computed."""
        fn(*args)

    def device_loader(self, loader: Iterable, sample: dict[str, torch.Tensor] | None = None) -> Iterator:
        for batch in loader:
            yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def even_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """``(batch, counted)`` for each batch; a sharded runtime pads the ranks with fewer batches
        with uncounted repeats, so that every rank runs the same forwards."""
        for batch in batches:
            yield batch, True

    # ----------------------------------------------------------- reductions
    def all_reduce_sum(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Sum statistics over workers; returns CPU float64 tensors."""
        reduced = {k: v.detach().to("cpu", torch.float64) for k, v in totals.items()}
        if self.world_size > 1 and dist.is_initialized():
            for key in sorted(reduced):
                tensor = reduced[key].to(self.collective_device)
                dist.all_reduce(tensor)
                reduced[key] = tensor.cpu()
        return reduced

    @torch.no_grad()
    def broadcast_buffers(self, model: nn.Module) -> None:
        """Give every worker rank 0's buffers (BatchNorm statistics drift apart
        between DDP forwards), so that all workers evaluate the same model."""
        if self.world_size <= 1 or not dist.is_initialized():
            return
        for buffer in model.buffers():
            shared = buffer.detach().to(self.collective_device)
            dist.broadcast(shared, src=0)
            buffer.copy_(shared.to(buffer.device))

    @property
    def collective_device(self) -> torch.device:
        return torch.device("cpu")

    # ---------------------------------------------------------- state / rng
    def rng_state(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def scaler_state(self) -> dict[str, Any] | None:
        """Loss-scaler state for checkpoints (fp16 only)."""
        return None

    def load_scaler_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`scaler_state`."""

    def to_cpu(self, obj: Any) -> Any:
        """Copy tensors (nested in dicts/lists) to the CPU, e.g. for a checkpoint."""
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu()
        if isinstance(obj, dict):
            return {k: self.to_cpu(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.to_cpu(v) for v in obj)
        return obj

    def begin_step(self, step: int) -> None:
        """Start of the training step after ``step`` steps (XLA notes the compile count and seeds the step)."""

    def end_step(self, step: int, steps_into_epoch: int) -> str | None:
        """End of a training step, its graph run: a warning text when something went wrong
        (XLA: a recompile after warm-up), else ``None``; may raise :class:`RecompileError`."""
        return None

    def metrics(self) -> dict[str, float]:
        """Backend counters worth logging (XLA compiles...)."""
        return {}

    def compile_seconds(self) -> float | None:
        """Seconds spent compiling so far, where a compiler says it (XLA); None elsewhere."""
        return None

    # ------------------------------------------------------------ profiling
    def profiler(self, directory: Path) -> Any:
        """A profiler of this worker (``start()`` / ``stop()``) that writes its trace under ``directory``."""
        return profiler_for(self.name, directory, self.rank)

    def step_trace(self, step: int) -> contextlib.AbstractContextManager:
        """Marks one training step in a trace (a range named ``raytpu step N``)."""
        return step_mark(self.name, step)

    def finish(self) -> None:
        """End of training: print reports, release resources."""


def clip_or_measure(params: list[nn.Parameter], max_norm: float, measure: bool = True) -> torch.Tensor | None:
    """Total gradient norm of ``params`` (a tensor, no host sync); clips in place when ``max_norm > 0``.
    Without clipping the norm is only computed when ``measure`` asks for it (None otherwise)."""
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=None)
    if not measure:
        return None
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=None)
