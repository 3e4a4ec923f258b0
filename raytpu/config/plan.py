"""The plan: a user's config resolved once, on the driver, into what every worker runs.

The config says what the user asked (``scaling.runtime: auto``, ``--per_device_train_batch_size
4``, a relative data path); the plan says what happens: the runtime found on the cluster, the
precision it gets, absolute paths, and the :class:`BatchPlan` (per-worker batch, accumulation
steps, data-parallel workers). It is frozen; it travels to the workers as plain values
(:meth:`Plan.as_dict`); a changed batch (``loop.auto_find_batch_size``) or a Tune trial is a new
plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytpu.config.batching import BatchPlan
from raytpu.config.loading import from_dict, to_dict, with_values
from raytpu.config.schema import Config
from raytpu.errors import ConfigError
from raytpu.runtime.placement import Placement
from raytpu.storage.filesystems import is_remote, join


@dataclass(frozen=True)
class ScriptPlan:
    """``raytpu launch``: the user's script and what its processes are told."""

    path: str
    args: tuple[str, ...] = ()
    working_dir: str = ""
    mixed_precision: str = "no"  # Accelerate's name: no | fp16 | bf16
    gradient_accumulation_steps: int = 1
    state: str = ""  # the name of the run's launch-state actor
    last_checkpoint: int = 0  # the highest checkpoint number the run folder held before this launch


@dataclass(frozen=True)
class Plan:
    """One run, resolved: the config as it runs (runtime, precision and batches settled, paths
    absolute), where it writes, and how its batch is split."""

    config: Config
    mode: str  # train | test | launch
    storage: str  # run.storage_path, absolute
    name: str  # the run's folder in it (``<run>``, or ``<run>/test-<time>`` for a test): Ray Train's name
    data_root: str = ""
    main_metric_mode: str = "min"
    split_sizes: tuple[tuple[str, int], ...] = ()  # samples in each split the driver checked
    datasets: tuple[str, ...] = ()  # the Ray Datasets given to the TorchTrainer
    stop: str = ""  # where a stop request is read (``raytpu.driver.signals``); "" = never
    script: ScriptPlan | None = None
    command: str = ""  # the id of the command that runs it (its part of the goodput record)
    started: float = 0.0  # when that command started (seconds since the epoch)

    @property
    def run_dir(self) -> str:
        return join(self.storage, self.name)

    @property
    def batch(self) -> BatchPlan:
        return BatchPlan.of(self.config)

    def changed(self, values: Mapping[str, Any]) -> Plan:
        """A new plan with dotted config keys changed (``{"loop.grad_accum": 4}``)."""
        return dataclasses.replace(self, config=with_values(self.config, values))

    def as_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["config"] = to_dict(self.config)
        values["script"] = dataclasses.asdict(self.script) if self.script else None
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Plan:
        config, _ = from_dict(values["config"])
        script = values.get("script")
        return cls(
            **{
                **values,
                "config": config,
                "split_sizes": tuple(tuple(pair) for pair in values.get("split_sizes", ())),
                "datasets": tuple(values.get("datasets", ())),
                "script": ScriptPlan(**{**script, "args": tuple(script["args"])}) if script else None,
            }
        )


# ----------------------------------------------------------------- resolution
def resolve_config(cfg: Config, runtime: str, precision: str, placement: Placement | None = None) -> Config:
    """The config as it runs on ``runtime`` at ``precision`` (and ``placement``: its worker count and
    each worker's TPU chips): per-device batches turned into global ones, gradient checkpointing
    routed to torch_xla's on xla, paths the workers read made absolute."""
    cfg = with_values(cfg, {"scaling.runtime": runtime, "scaling.precision": precision, **placed(cfg, placement)})
    values: dict[str, Any] = per_device_batches(cfg)
    if runtime == "xla" and getattr(cfg.job, "gradient_checkpointing", False):
        # XLA's common-subexpression elimination merges a plain checkpoint's recomputation back into
        # the forward, saving no memory: torch_xla's own puts an optimization barrier in its way
        values.update({"job.gradient_checkpointing": False, "xla.grad_ckpt": True})
    if cfg.checkpoint.weights and not is_remote(cfg.checkpoint.weights) and Path(cfg.checkpoint.weights).exists():
        values["checkpoint.weights"] = str(Path(cfg.checkpoint.weights).resolve())
    if cfg.xla.compile_cache not in ("", "none"):
        values["xla.compile_cache"] = str(Path(cfg.xla.compile_cache).resolve())
    resolved = with_values(cfg, values)
    BatchPlan.of(resolved)  # checks the split
    return resolved


def placed(cfg: Config, placement: Placement | None) -> dict[str, Any]:
    """The worker count the placement runs and the TPU each xla worker asks Ray for: a whole slice
    that several workers form, else its chips (unless the config asks for some itself)."""
    if placement is None:
        return {}
    values: dict[str, Any] = {"scaling.num_workers": placement.num_workers}
    accelerator_type, topology = placement.tpu_slice
    if accelerator_type:
        values.update({"scaling.tpu.accelerator_type": accelerator_type, "scaling.tpu.topology": topology})
    elif placement.tpu_chips and "TPU" not in cfg.scaling.resources_per_worker:
        values["scaling.resources_per_worker"] = {**cfg.scaling.resources_per_worker, "TPU": placement.tpu_chips}
    return values


def per_device_batches(cfg: Config) -> dict[str, int]:
    """TrainingArguments' ``--per_device_train_batch_size`` / ``--per_device_eval_batch_size`` as the
    global batches they make: x data-parallel replicas (x accumulation steps for training)."""
    data = cfg.data
    if not (data.per_device_train_batch_size or data.per_device_eval_batch_size):
        return {}
    replicas = data_parallel_replicas(cfg)
    values = {}
    if data.per_device_train_batch_size:
        values["data.global_batch_size"] = data.per_device_train_batch_size * replicas * cfg.loop.grad_accum
    if data.per_device_eval_batch_size:
        values["data.eval_batch_size"] = data.per_device_eval_batch_size * replicas
    return values


def data_parallel_replicas(cfg: Config) -> int:
    """What TrainingArguments' "per device" counts: a worker on cpu and cuda (and with one chip per
    process on XLA), a chip under SPMD, where each worker drives its host's chips."""
    scaling = cfg.scaling
    if scaling.runtime != "xla" or scaling.tpu.layout == "multiprocess":
        return scaling.num_workers
    if not scaling.tpu.accelerator_type and scaling.resources_per_worker.get("TPU"):  # a host's chips each
        return int(scaling.resources_per_worker["TPU"]) * scaling.num_workers
    if not scaling.tpu.accelerator_type:
        raise ConfigError(
            "per-device batch sizes on xla need the slice's chip count: set scaling.tpu.accelerator_type "
            "(and topology), or give data.global_batch_size instead"
        )
    from raytpu.runtime.tpu import slice_spec

    return slice_spec(scaling.tpu.accelerator_type, scaling.tpu.topology).num_chips


def storage_of(cfg: Config) -> str:
    """``run.storage_path``: a bucket URI as it is, a local folder made absolute."""
    storage = cfg.run.storage_path
    return storage.rstrip("/") if is_remote(storage) else str(Path(storage).resolve())
