"""Each device's memory for a training step, estimated before anything starts: arithmetic over
the parameter counts of the config's model, built on the meta device (no weights are made), so that
a run that cannot fit is refused in one line (:func:`check_memory`) instead of failing with an
out-of-memory error minutes later; ``raytpu doctor CONFIG`` shows it (:func:`estimate_lines`).

What one device holds (bytes; ``P`` parameters, ``N`` shards: the workers when the model is
sharded, else 1; ``c`` the bytes of a computed value: 2 in bf16, 4 in fp32):

* weights: the fp32 parameters, ``4 P / N``; a bf16 data-parallel step also keeps the bf16 copy
  autocast makes of each weight for the backward (``2 P``), an fp8 step its float8 copy (``P``);
* gradients: ``4 P / N``; DDP over several workers keeps a second copy in its all-reduce buckets;
* optimizer state: ``8 P / N`` for Adam and AdamW (two moments), ``4 P / N`` for SGD with
  momentum and Adagrad, none counted for Adafactor (factored: a few percent);
* gathered (sharded only): FSDP2 gathers the root's own parameters for the whole step and one
  unit at a time, the next prefetched, each in the compute dtype, and the unit's gradient whole
  before it is reduced: ``c (P_root + 2 U) + (c + 4) U`` for the largest unit ``U``;
* a tensor axis of ``t`` workers (``sharding.mesh.tensor``): the weights its layers split are held
  ``1/t`` each (``N`` = fsdp x tensor shards for them, ``N / t`` for the rest), and so is their part
  of a gathered unit; the activations are the job's at the per-worker batch (a tensor group's
  workers share its samples), not divided by ``t``: an upper bound, since the split layers' own
  activations are split too;
* activations: what the job declares (``raytpu.job.EstimatesActivations``) at the per-device
  batch, with or without activation checkpointing.

The check leaves a tenth of the device to the CUDA context, the allocator's fragmentation and
the data (``USABLE``). Each device's memory is what its runtime's description knows
(``raytpu.runtime.builtin``: GPUs by kind). The benchmark ``bench/gpu_throughput.py`` compares the estimate with
``torch.cuda.max_memory_allocated`` on a GPU (docs/dev/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from raytpu.config.batching import BatchPlan
from raytpu.config.loading import with_values
from raytpu.config.schema import Config
from raytpu.errors import ConfigError
from raytpu.job import EstimatesActivations, Job, empty_build
from raytpu.parallel.tensor import tensor_plan
from raytpu.runtime.kinds import LOW_PRECISIONS, compiles, kind_of, registered
from raytpu.runtime.torch_fsdp import units_of, wrapping_units

GB = 1e9

#: the share of a device's memory a run may plan to use
USABLE = 0.9

#: optimizer state, bytes per parameter (fp32 state)
OPTIMIZER_BYTES = {"adam": 8, "adamw": 8, "sgd": 4, "adagrad": 4, "adafactor": 0}


@dataclass(frozen=True)
class ModelSize:
    """What the estimate needs of a model: its trainable parameters, those of its largest unit
    (a decoder layer) and those the root holds itself (embeddings, head: outside every unit); and
    of each, the part tensor parallelism splits (the plan's layers)."""

    parameters: int
    largest_unit: int
    root: int
    split: int = 0
    split_unit: int = 0
    frozen_bytes: float = 0.0  # the parameters that do not train (a LoRA run's base), in their own dtype

    @classmethod
    def of(cls, model: nn.Module, units: list[nn.Module], split_layers: list[str] = ()) -> ModelSize:
        total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sizes = [sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in units]
        split = {id(p) for name in split_layers for p in model.get_submodule(name).parameters()}
        largest = max(units, key=lambda unit: sum(p.numel() for p in unit.parameters()), default=None)
        in_unit = sum(p.numel() for p in largest.parameters() if id(p) in split) if largest is not None else 0
        split_total = sum(p.numel() for p in model.parameters() if id(p) in split)
        frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
        return cls(total, max(sizes, default=0), total - sum(sizes), split_total, in_unit, float(frozen))

    def held(self, tensor: int) -> tuple[float, float]:
        """The parameters and the largest unit's, counted as a tensor group of ``tensor`` holds them."""
        return (
            self.parameters - self.split + self.split / tensor,
            self.largest_unit - self.split_unit + self.split_unit / tensor,
        )


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
    tensor: int = 1,
) -> MemoryEstimate:
    """One device's bytes for a step (the module docstring gives the arithmetic); ``tensor``: the
    workers of a tensor group (``workers`` counts them all)."""
    compute = 2 if precision in LOW_PRECISIONS else 4
    shards = workers // tensor if sharded else 1
    params, unit = size.held(tensor) if tensor > 1 else (size.parameters, size.largest_unit)
    weights = 4 * params / shards + size.frozen_bytes / shards  # a frozen base: its own dtype, no gradient or state
    gradients = 4 * params / shards
    gathered = 0.0
    if sharded:
        gathered = compute * (size.root + 2 * unit) + (compute + 4) * unit
    else:
        if compute == 2:  # the low-precision copy of every weight kept for the backward: fp8's in 1 byte
            weights += (1 if precision == "fp8" else 2) * params
        if workers > 1:
            gradients *= 2  # DDP's all-reduce buckets
    state = OPTIMIZER_BYTES.get(optimizer, 8) * params / shards
    return MemoryEstimate(weights, gradients, state, gathered, activations)


def tensor_group(cfg: Config) -> int:
    """The workers of a tensor group: those reading the same samples (1 where the mesh is within
    each worker's devices, xla's)."""
    return cfg.scaling.num_workers // BatchPlan.of(cfg).workers


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


def estimate_run(cfg: Config, job: Job, precision: str | None = None) -> MemoryEstimate:
    """One device's bytes for a training step of ``cfg`` (its runtime's precision unless given)."""
    precision = precision or cfg.scaling.precision
    cfg = with_values(cfg, {"scaling.precision": precision})  # what the job's activations count in
    with empty_build():  # on the meta device; a pretrained architecture from its config
        model = job.build_model(cfg)
    units = units_of(model, wrapping_units(model, list(cfg.sharding.layers)))
    sharded = cfg.sharding.strategy != "none"
    value_bytes = 2 if precision in LOW_PRECISIONS else 4
    activations = None
    if isinstance(job, EstimatesActivations):
        batch = BatchPlan.of(cfg).per_worker
        compiled = compiles(cfg.scaling.runtime, cfg.loop.compile)
        activations = job.activation_bytes(cfg, batch, value_bytes, checkpointed(cfg), compiled=compiled)
    workers, tensor = cfg.scaling.num_workers, tensor_group(cfg)
    split = list(tensor_plan(model)) if tensor > 1 else []
    size = ModelSize.of(model, units, split)
    return estimate(size, precision, cfg.optim.name, workers, sharded, activations, tensor)


def checkpointed(cfg: Config) -> bool:
    return cfg.sharding.activation_checkpointing or bool(getattr(cfg.job, "gradient_checkpointing", False))


def device_memory(cfg: Config, gpu_kinds: frozenset[str]) -> tuple[float | None, str]:
    """Each device's memory in GB and what it is (``an H100``): ``scaling.device_memory_gb``, else
    what the runtime's description knows (on cuda the smallest of the cluster's GPUs by kind, or
    this machine's GPU); None where unknown."""
    if cfg.scaling.device_memory_gb:
        return cfg.scaling.device_memory_gb, "a device (scaling.device_memory_gb)"
    if cfg.scaling.runtime == "auto":
        return None, ""
    return kind_of(cfg.scaling.runtime).device_memory_gb(gpu_kinds)


def check_memory(cfg: Config, job: Job, gpu_kinds: frozenset[str]) -> list[str]:
    """The plan's note on memory, or a :class:`ConfigError` naming what to change when the
    estimate exceeds :data:`USABLE` of each device's memory. Nothing where the memory is unknown
    (cpu without ``scaling.device_memory_gb``, xla)."""
    memory, what = device_memory(cfg, gpu_kinds)
    if memory is None or cfg.run.mode != "train":
        return []
    found = estimate_run(cfg, job)
    line = f"about {size(found.total)} per device ({found.parts()})"
    if found.total > USABLE * memory * GB:
        share = (found.activations or 0.0) / found.total
        sharded = cfg.sharding.strategy != "none"
        if not cfg.scaling.check_memory:
            return [
                f"warning: memory: {line}, more than {USABLE:.0%} of {memory:g} GB; starting it anyway "
                "(scaling.check_memory=false)"
            ]
        raise ConfigError(
            f"this run needs {line}, more than {USABLE:.0%} of the {memory:g} GB of {what}: "
            f"{advice(sharded, checkpointed(cfg), share)}; or, to start it anyway, scaling.check_memory=false"
        )
    return [f"memory: {line} of {memory:g} GB"]


def estimate_lines(cfg: Config, job: Job, gpu_kinds: frozenset[str] = frozenset()) -> list[str]:
    """``raytpu doctor CONFIG``: the estimate of the config as it is and with sharding and activation
    checkpointing each on and off, per device of its ``scaling.num_workers``, against the device's
    memory where known."""
    from raytpu.config.plan import per_device_batches

    cfg = with_values(cfg, per_device_batches(cfg))
    memory, what = device_memory(cfg, gpu_kinds)
    against = f" of {memory:g} GB ({what})" if memory else ""
    precision = cfg.scaling.precision if cfg.scaling.precision != "auto" else default_precision(cfg.scaling.runtime)
    lines = [f"{cfg.scaling.runtime} x {cfg.scaling.num_workers} worker(s), {precision}, per device{against}:"]
    for strategy in ("none", "full_shard"):
        for recompute in (False, True):
            variant = with_values(
                cfg,
                {
                    "sharding.strategy": strategy,
                    "sharding.activation_checkpointing": recompute,
                    **({"job.gradient_checkpointing": False} if hasattr(cfg.job, "gradient_checkpointing") else {}),
                },
            )
            found = estimate_run(variant, job, precision)
            fits = "" if not memory else ("  fits" if found.total <= USABLE * memory * GB else "  does not fit")
            chosen = strategy == cfg.sharding.strategy and recompute == checkpointed(cfg)
            name = f"{'sharded' if strategy != 'none' else 'data-parallel'}, {'' if recompute else 'no '}checkpointing"
            mark = " <- the config" if chosen else ""
            lines.append(f"  {name:<33} {size(found.total):>9}{fits}  ({found.parts()}){mark}")
    return lines


def default_precision(runtime: str) -> str:
    """``precision: auto``'s choice where the device is not at hand (a GPU with bf16; ``auto``: the CPU's)."""
    return kind_of(runtime if runtime in registered() else "cpu").precision("auto")[0]
