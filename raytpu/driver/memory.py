"""A run's memory per device before it starts (``raytpu.runtime.memory``'s arithmetic on the
config's model, built on the meta device: no weights are made): refused in one line when it
cannot fit, said in the plan's notes when it can, shown by ``raytpu doctor CONFIG``."""

from __future__ import annotations

import torch

from raytpu.config import Config, with_values
from raytpu.config.batching import BatchPlan
from raytpu.errors import ConfigError
from raytpu.job import EstimatesActivations, Job
from raytpu.runtime.fsdp import units_of, wrapping_units
from raytpu.runtime.memory import GB, USABLE, MemoryEstimate, ModelSize, advice, device_memory_gb, estimate, size


def estimate_run(cfg: Config, job: Job, precision: str | None = None) -> MemoryEstimate:
    """One device's bytes for a training step of ``cfg`` (its runtime's precision unless given)."""
    precision = precision or cfg.scaling.precision
    with torch.device("meta"):
        model = job.build_model(cfg)
    units = units_of(model, wrapping_units(model, list(cfg.sharding.layers)))
    sharded = cfg.sharding.strategy != "none"
    value_bytes = 2 if precision in ("bf16", "fp16") else 4
    activations = None
    if isinstance(job, EstimatesActivations):
        batch = BatchPlan.of(cfg).per_worker
        activations = job.activation_bytes(cfg, batch, value_bytes, checkpointed(cfg))
    workers = cfg.scaling.num_workers
    return estimate(ModelSize.of(model, units), precision, cfg.optim.name, workers, sharded, activations)


def checkpointed(cfg: Config) -> bool:
    return cfg.sharding.activation_checkpointing or bool(getattr(cfg.job, "gradient_checkpointing", False))


def device_memory(cfg: Config, gpu_kinds: frozenset[str]) -> tuple[float | None, str]:
    """Each device's memory in GB and what it is (``an H100``): ``scaling.device_memory_gb``, else
    on cuda the smallest of the cluster's GPUs by kind, or this machine's GPU; None where unknown."""
    if cfg.scaling.device_memory_gb:
        return cfg.scaling.device_memory_gb, "a device (scaling.device_memory_gb)"
    if cfg.scaling.runtime != "cuda":
        return None, ""
    known = device_memory_gb(gpu_kinds)
    if known is not None:
        return known, f"a GPU of this cluster ({', '.join(sorted(gpu_kinds))})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GB, f"this machine's {props.name}"
    return None, ""


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
        raise ConfigError(
            f"this run needs {line}, more than {USABLE:.0%} of the {memory:g} GB of {what}: "
            f"{advice(sharded, checkpointed(cfg), share)}"
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
    """``precision: auto``'s choice where the device is not at hand (a GPU with bf16)."""
    from raytpu.runtime.base import resolve_precision

    return resolve_precision(runtime if runtime != "auto" else "cpu", "auto")[0]
