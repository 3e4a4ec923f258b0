"""Every config value's choice, type and range, checked on the driver before anything runs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from raytpu.config.batching import BatchPlan, elastic_plans
from raytpu.errors import ConfigError
from raytpu.hooks import callback_class
from raytpu.job import ReadsText
from raytpu.parallel.mesh import check_axes
from raytpu.runtime.kinds import FP8_RECIPES, PRECISIONS, kind_of

if TYPE_CHECKING:  # raytpu.config (loading) imports this module
    from raytpu.config import Config
    from raytpu.job import Job

#: where a run's scalars can go (``logging.report_to``)
TRACKERS = ("tensorboard", "mlflow", "wandb")

CHOICES: dict[str, tuple[str, ...]] = {
    "run.mode": ("train", "test"),
    "scaling.precision": PRECISIONS,
    "scaling.fp8_recipe": FP8_RECIPES,
    "sharding.strategy": ("none", "full_shard"),
    "logging.wandb_mode": ("", "online", "offline", "disabled"),
    "scaling.tpu.layout": ("spmd", "multiprocess"),
    "data.loader": ("torch", "ray"),
    "optim.name": ("adafactor", "adagrad", "adam", "adamw", "sgd"),
    "optim.scheduler": ("constant", "cosine", "linear", "poly"),
    "loop.sync_batchnorm": ("auto", "true", "false"),
    "loop.compile": ("auto", "true", "false"),
    "loop.compile_mode": ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    "tune.scheduler": ("asha", "fifo", "pbt"),
    "tune.search_alg": ("random", "optuna"),
    "tune.mode": ("", "max", "min"),
    "tune.lr_scaling": ("none", "linear", "sqrt"),
}

#: dotted key -> (lowest allowed value, whether the lowest value itself is allowed)
LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "run.seed": (0, True),
    "scaling.num_workers": (1, True),
    "scaling.min_workers": (0, True),
    "scaling.tpu.slices": (1, True),
    "scaling.tpu.min_slices": (0, True),
    "scaling.cpus_per_worker": (0, True),
    "scaling.device_memory_gb": (0, True),
    "scaling.node_start_timeout_s": (0, False),
    "data.global_batch_size": (1, True),
    "data.eval_batch_size": (0, True),
    "data.per_device_train_batch_size": (0, True),
    "data.per_device_eval_batch_size": (0, True),
    "data.num_workers": (0, True),
    "data.prefetch_batches": (0, True),
    "data.shuffle_buffer": (0, True),
    "data.materialize_mb": (0, True),
    "optim.lr": (0, False),
    "optim.weight_decay": (0, True),
    "optim.momentum": (0, True),
    "optim.warmup_steps": (0, True),
    "optim.warmup_ratio": (0, True),
    "optim.eps": (0, False),
    "optim.min_lr_ratio": (0, True),
    "loop.epochs": (1, True),
    "loop.max_steps": (0, True),
    "loop.grad_accum": (1, True),
    "loop.clip_grad_norm": (0, True),
    "loop.ema_beta": (0, True),
    "loop.ema_every": (1, True),
    "loop.ema_update_after": (0, True),
    "loop.ema_power": (0, False),
    "loop.log_every": (1, True),
    "loop.eval_every_epochs": (1, True),
    "loop.eval_every_steps": (0, True),
    "loop.grad_norm_warn_high": (0, False),
    "loop.grad_norm_warn_low": (0, True),
    "checkpoint.every_steps": (0, True),
    "checkpoint.num_to_keep": (1, True),
    "checkpoint.max_failures": (-1, True),
    "logging.eval_images": (0, True),
    "logging.flush_every_s": (0, True),
    "tune.num_samples": (1, True),
    "tune.max_t": (0, True),
    "tune.grace_period": (1, True),
    "tune.reduction_factor": (1, False),
    "tune.max_concurrent": (0, True),
    "tune.reference_batch_size": (0, True),
    "tune.perturbation_interval": (1, True),
    "tune.quantile_fraction": (0, False),
}

#: dotted key -> (highest allowed value, whether that value itself is allowed)
UPPER_BOUNDS: dict[str, tuple[float, bool]] = {
    "optim.momentum": (1, False),
    "optim.min_lr_ratio": (1, True),
    "optim.warmup_ratio": (1, True),
    "loop.ema_beta": (1, False),
    "tune.quantile_fraction": (0.5, True),
}


def get_dotted(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate(cfg: Config, job: Job | None = None) -> None:
    """Every value's choice, type and range, checked before anything runs (one-line errors)."""
    for key, allowed in CHOICES.items():
        value = get_dotted(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(a for a in allowed if a)}")
    if cfg.scaling.runtime != "auto":
        kind_of(cfg.scaling.runtime)  # a registered runtime, or a module that describes one
    for key, (low, inclusive) in LOWER_BOUNDS.items():
        check_number(key, get_dotted(cfg, key), (low, inclusive), UPPER_BOUNDS.get(key))
    for step, lr in cfg.optim.lr_changes.items():
        if not (isinstance(step, int) and step >= 0 and isinstance(lr, (int, float)) and lr > 0):
            raise ConfigError(
                f"optim.lr_changes maps a step (a whole number, at least 0) to the base lr from then on, "
                f"e.g. {{0: 0.01, 40: 0.012}}; got {step!r}: {lr!r}"
            )
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {betas}")
    for name, amount in cfg.scaling.resources_per_worker.items():
        check_number(f"scaling.resources_per_worker.{name}", amount, (0, True))
    check_axes(cfg.sharding.mesh.data, cfg.sharding.mesh.fsdp, cfg.sharding.mesh.tensor)
    check_profile(cfg.loop.profile_steps, cfg.loop.profile_ranks, cfg.scaling.num_workers)
    check_range("scaling.num_workers", cfg.scaling.min_workers, cfg.scaling.num_workers)
    check_range("scaling.tpu.slices", cfg.scaling.tpu.min_slices, cfg.scaling.tpu.slices)
    if (cfg.scaling.min_workers or cfg.scaling.tpu.min_slices) and cfg.loop.auto_find_batch_size:
        raise ConfigError(
            "loop.auto_find_batch_size with a range of workers: an elastic run keeps each worker's micro-batch "
            "at or below its largest size's; give one size, or leave the finder off"
        )
    elastic = cfg.scaling.min_workers or cfg.scaling.tpu.min_slices
    if elastic and cfg.data.loader == "ray" and not isinstance(job, ReadsText):
        raise ConfigError(
            "an elastic run (a range of workers) needs data.loader=torch: Ray Data splits the train set anew at "
            "each size, so a resumed epoch would not continue at its exact sample (a streamed text corpus, whose "
            "steps are the same blocks at every size, may be elastic)"
        )
    unknown = [name for name in cfg.logging.report_to if name not in TRACKERS]
    if unknown:
        raise ConfigError(f"logging.report_to: {', '.join(map(str, unknown))} is not one of {', '.join(TRACKERS)}")
    for name in cfg.loop.callbacks:  # imported here, on the driver: a wrong name fails before any worker
        callback_class(name)
    if not cfg.data.per_device_train_batch_size:  # else checked once the runtime is known
        if cfg.scaling.min_workers:
            elastic_plans(cfg, range(cfg.scaling.min_workers, cfg.scaling.num_workers + 1))
        BatchPlan.of(cfg)
    if job is not None:
        job.check_config(cfg)


def check_range(key: str, low: int, high: int) -> None:
    """An elastic range: its smallest size at least 1 and at most its largest (``low`` 0: fixed)."""
    if low and low > high:
        raise ConfigError(f"{key}={low}:{high}: the smallest size must be at most the largest, e.g. {key}={high}:{low}")


def check_profile(steps: list[int], ranks: list[int], workers: int) -> None:
    """``loop.profile_steps``: none, or ``[first, last]`` with 1 <= first <= last; ranks among the workers."""
    if steps and (len(steps) != 2 or not all(isinstance(s, int) for s in steps) or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(f"loop.profile_steps must be [first, last] steps with 1 <= first <= last, got {steps}")
    outside = [rank for rank in ranks if not isinstance(rank, int) or not 0 <= rank < workers]
    if steps and outside:
        raise ConfigError(f"loop.profile_ranks {outside} are not ranks of the {workers} worker(s)")


def check_number(key: str, value: Any, lower: tuple[float, bool], upper: tuple[float, bool] | None = None) -> None:
    """A finite number within ``lower`` and ``upper``, each ``(bound, whether the bound itself is allowed)``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    low, low_ok = lower
    if value < low or (value == low and not low_ok):
        raise ConfigError(f"{key} must be {'at least' if low_ok else 'greater than'} {low:g}, got {value!r}")
    if upper is not None:
        high, high_ok = upper
        if value > high or (value == high and not high_ok):
            raise ConfigError(f"{key} must be {'at most' if high_ok else 'below'} {high:g}, got {value!r}")
