"""Each device's memory for a training step, estimated before anything starts: pure arithmetic
over the model's parameter counts, so that a run that cannot fit is refused in one line instead
of failing with an out-of-memory error minutes later.

What one device holds (bytes; ``P`` parameters, ``N`` shards: the workers when the model is
sharded, else 1; ``c`` the bytes of a computed value: 2 in bf16, 4 in fp32):

* weights: the fp32 parameters, ``4 P / N``; a bf16 data-parallel step also keeps the bf16 copy
  autocast makes of each weight for the backward (``2 P``);
* gradients: ``4 P / N``; DDP over several workers keeps a second copy in its all-reduce buckets;
* optimizer state: ``8 P / N`` for Adam and AdamW (two moments), ``4 P / N`` for SGD with
  momentum and Adagrad, none counted for Adafactor (factored: a few percent);
* gathered (sharded only): FSDP2 gathers the root's own parameters for the whole step and one
  unit at a time, the next prefetched, each in the compute dtype, and the unit's gradient whole
  before it is reduced: ``c (P_root + 2 U) + (c + 4) U`` for the largest unit ``U``;
* activations: what the job declares (``raytpu.job.EstimatesActivations``) at the per-device
  batch, with or without activation checkpointing.

The check leaves a tenth of the device to the CUDA context, the allocator's fragmentation and
the data (``USABLE``). The benchmark ``bench/gpu_throughput.py`` compares the estimate with
``torch.cuda.max_memory_allocated`` on a GPU (docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

GB = 1e9

#: the share of a device's memory a run may plan to use
USABLE = 0.9

#: optimizer state, bytes per parameter (fp32 state)
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "adagrad": 4, "adafactor": 0}

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


@dataclass(frozen=True)
class ModelSize:
    """What the estimate needs of a model: its trainable parameters, those of its largest unit
    (a decoder layer) and those the root holds itself (embeddings, head: outside every unit)."""

    parameters: int
    largest_unit: int
    root: int

    @classmethod
    def of(cls, model: nn.Module, units: list[nn.Module]) -> ModelSize:
        total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sizes = [sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in units]
        return cls(total, max(sizes, default=0), total - sum(sizes))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds during a training step, by kind; ``activations`` None where the job
    does not say."""

    weights: float
    gradients: float
    optimizer: float
    gathered: float
    activations: float | None

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.gathered + (self.activations or 0.0)

    def parts(self) -> str:
        """``weights 16.1 GB, gradients 16.1 GB, ...``: each kind in GB."""
        named = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer state": self.optimizer,
            "gathered units": self.gathered,
        }
        text = ", ".join(f"{name} {size(value)}" for name, value in named.items() if value)
        activations = "not estimated by the job" if self.activations is None else size(self.activations)
        return f"{text}, activations {activations}"


def size(value: float) -> str:
    """Bytes in GB (``12.3 GB``), or MB below a GB (``412 MB``)."""
    return f"{value / GB:.1f} GB" if value >= GB else f"{value / 1e6:.0f} MB"


def estimate(
    size: ModelSize,
    precision: str,
    optimizer: str,
    workers: int,
    sharded: bool,
    activations: float | None,
) -> MemoryEstimate:
    """One device's bytes for a step (the module docstring gives the arithmetic)."""
    compute = 2 if precision in ("bf16", "fp16") else 4
    shards = workers if sharded else 1
    params = size.parameters
    weights = 4 * params / shards
    gradients = 4 * params / shards
    gathered = 0.0
    if sharded:
        gathered = compute * (size.root + 2 * size.largest_unit) + (compute + 4) * size.largest_unit
    else:
        if compute == 2:
            weights += 2 * params  # autocast's low-precision copy of every weight, kept for the backward
        if workers > 1:
            gradients *= 2  # DDP's all-reduce buckets
    state = OPTIMIZER_BYTES.get(optimizer, 8) * params / shards
    return MemoryEstimate(weights, gradients, state, gathered, activations)


def device_memory_gb(kinds: set[str] | list[str]) -> float | None:
    """The smallest memory of the GPUs named (Ray's names or CUDA's), or None when none is known."""
    known = [memory_of(kind) for kind in kinds]
    found = [memory for memory in known if memory is not None]
    return min(found) if found else None


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


def advice(cfg_sharded: bool, checkpointed: bool, activations_share: float) -> str:
    """What to change, most effective first: shard, checkpoint activations, lower the batch."""
    steps = []
    if not cfg_sharded:
        steps.append("shard the model over the workers (--fsdp full_shard, sharding.strategy=full_shard)")
    else:
        steps.append("shard it over more workers (scaling.num_workers)")
    if not checkpointed and activations_share > 0.1:
        steps.append("checkpoint activations (--gradient_checkpointing, sharding.activation_checkpointing=true)")
    steps.append("lower the per-device batch (data.global_batch_size, with loop.grad_accum to keep the global batch)")
    return "; ".join(steps)
