"""Typed configuration: dataclasses, YAML files, dotted overrides and seed-script aliases.

A config file is YAML with one section per dataclass below plus ``job:`` (the
job's own dataclass, selected by ``job.name``). Command-line overrides are
``section.key=value`` (values parsed as YAML) or a seed script's flag
(``--batch-size 8``), read by ``raytpu.args``. Any unknown key fails with the
closest valid keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raytpu.args import Alias, ConfigError, mapping_as_flags, parse_overrides
from raytpu.job import Job, JobConfig, load_job
from raytpu.training_args import TRAINING_ARGUMENTS
from raytpu.validation import validate


@dataclass
class RunConfig:
    name: str = ""
    storage_path: str = "./results"
    seed: int = 0
    mode: str = "train"  # train | test


@dataclass
class TPUConfig:
    accelerator_type: str = ""  # e.g. TPU-V5LITEPOD, TPU-V4, TPU-V6E
    topology: str = ""  # e.g. 2x4
    layout: str = "spmd"  # spmd | multiprocess


@dataclass
class ScalingConfig:
    runtime: str = "auto"  # auto | cpu | cuda | xla
    num_workers: int = 1
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    cpus_per_worker: float = 1.0
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    tpu: TPUConfig = field(default_factory=TPUConfig)


@dataclass
class MeshConfig:
    data: int = -1
    fsdp: int = 1


@dataclass
class XLAConfig:
    spmd: bool = False
    mesh: MeshConfig = field(default_factory=MeshConfig)
    compile_cache: str = ""  # "" = <run dir>/xla_cache; "none" disables it
    strict_recompile: bool = False
    debug_metrics: bool = False
    # FSDPv2's wrapping units by class name ([] = the model's _no_split_modules: decoder layers)
    fsdp_layers: list[str] = field(default_factory=list)
    grad_ckpt: bool = False  # torch_xla's gradient checkpointing of each unit (Transformers' xla_fsdp_grad_ckpt)


@dataclass
class DataConfig:
    path: str = ""
    synthesize_if_missing: bool = False
    global_batch_size: int = 8
    eval_batch_size: int = 0  # 0 = global_batch_size
    # TrainingArguments' per-device batches (0 = unused): x data-parallel replicas (x grad_accum) = the global batch
    per_device_train_batch_size: int = 0
    per_device_eval_batch_size: int = 0
    num_workers: int = 0  # DataLoader processes per Ray worker
    loader: str = "torch"  # torch | ray
    shuffle: bool = True
    prefetch_batches: int = 2  # data.loader=ray: batches each worker decodes ahead (in as many threads)
    shuffle_buffer: int = 0  # data.loader=ray: local shuffle buffer rows per worker (0 = 8 x per-worker batch)
    materialize_mb: float = 1024  # data.loader=ray: a train set this small is read once, reshuffled each epoch


@dataclass
class OptimConfig:
    name: str = "adamw"  # adafactor | adagrad | adam | adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8  # adam / adamw
    scheduler: str = "constant"  # constant | cosine | linear | poly
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps is 0: ceil(ratio x total steps) warm-up steps
    min_lr_ratio: float = 0.0


@dataclass
class LoopConfig:
    epochs: int = 1
    max_steps: int = 0  # 0 = epochs * steps per epoch
    grad_accum: int = 1
    auto_find_batch_size: bool = False  # halve the per-device batch (doubling grad_accum) on out-of-memory
    clip_grad_norm: float = 0.0  # 0 = no clipping
    ema_beta: float = 0.0  # 0 = no EMA of the weights; else the decay it reaches
    ema_every: int = 1  # steps between EMA updates
    ema_update_after: int = 100  # steps during which the EMA copies the weights (ema_pytorch's default)
    ema_warmup: bool = True  # ramp the decay as 1 - (1 + n)^-ema_power up to ema_beta (false: ema_beta at once)
    ema_power: float = 2 / 3
    log_every: int = 10
    eval_every_epochs: int = 1
    eval_every_steps: int = 0  # evaluate every that many steps instead (TrainingArguments' eval_steps)
    sync_batchnorm: str = "auto"  # auto | true | false: BatchNorm statistics over the global batch (see README)
    stop_on_nonfinite: bool = True
    grad_norm_warn_high: float = 1e3
    grad_norm_warn_low: float = 1e-7
    fail_at_step: int = 0  # fault injection for tests: raise once at this step (0 = off)


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0 = at the end of every epoch
    num_to_keep: int = 2
    resume: bool = True  # continue from the run's latest checkpoint when there is one
    weights: str = ""  # checkpoint dir or weights file to start from / to test
    max_failures: int = 0


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    progress_bar: bool = True
    eval_images: int = 4  # images per eval written to TensorBoard (0 = none)
    verbose: bool = False  # show Ray's own INFO lines (reports, checkpoints, scheduling) too
    hparams: bool = True  # the config's values in TensorBoard's HPARAMS tab once training completes


@dataclass
class TuneConfig:
    """``raytpu tune``: what to search and how (the CLI flags set the same keys)."""

    search: dict[str, str] = field(default_factory=dict)  # key -> "loguniform(1e-4, 1e-1)"
    num_samples: int = 4
    metric: str = ""  # "" = valid/<the job's main metric>
    mode: str = ""  # max | min; "" = the job's
    scheduler: str = "asha"  # asha | fifo
    max_t: int = 0  # ASHA horizon in reports (eval rounds); 0 = the reports a full trial makes
    grace_period: int = 1
    reduction_factor: float = 2.0
    max_concurrent: int = 0  # 0 = as many as the cluster's resources fit
    name: str = ""  # "" = <run.name>-tune; the same name resumes the sweep
    lr_scaling: str = "none"  # none | linear | sqrt, relative to reference_batch_size
    reference_batch_size: int = 0  # 0 = the config's data.global_batch_size


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    run: RunConfig = field(default_factory=RunConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    xla: XLAConfig = field(default_factory=XLAConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)


#: flags and short keys every job accepts: alias -> dotted key
COMMON_ALIASES: dict[str, Alias] = {
    "runtime": "scaling.runtime",
    "num_workers": "scaling.num_workers",
    "precision": "scaling.precision",
    "--name": "run.name",
    "--seed": "run.seed",
    "--data-path": "data.path",
    **TRAINING_ARGUMENTS,
}


# ---------------------------------------------------------------------- build
def load_config(path: str | Path | None, overrides: list[str] | None = None) -> tuple[Config, Job]:
    """Read a YAML file, apply ``overrides`` and return the typed config and its job."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; pass a YAML file such as jobs/mshnet/small.yaml")
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
    job_section = raw.get("job") or {}
    if isinstance(job_section, str):
        job_section = {"name": job_section}
        raw["job"] = job_section
    flags = mapping_as_flags("training_arguments", raw.pop("training_arguments")) if "training_arguments" in raw else []
    pairs = parse_overrides(flags + list(overrides or []), job_aliases_for(raw, overrides or []))
    job_name = dict(pairs).get("job.name", job_section.get("name"))
    if not job_name:
        raise ConfigError("no job given: set `job: {name: <job>}` in the config or pass job.name=<job>")
    job = load_job(str(job_name))
    cfg = build_dataclass(Config, raw, "", {"job": job.config_class})
    for key, value in pairs:
        set_dotted(cfg, key, value)
    validate(cfg, job)
    return cfg, job


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a syntax error names the file, line and column."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML syntax error: {' '.join(str(exc).split())}") from exc


def job_aliases_for(raw: dict[str, Any], overrides: list[str]) -> dict[str, Alias]:
    """Aliases of the job named in the file or the overrides (seed flags)."""
    name = (raw.get("job") or {}).get("name")
    for item in overrides:
        if item.startswith("job.name="):
            name = item.split("=", 1)[1]
    aliases = dict(COMMON_ALIASES)
    if name:
        aliases.update(load_job(str(name)).aliases)
    return aliases


def build_dataclass(cls: type, raw: Any, prefix: str, substitutions: dict[str, type] | None = None) -> Any:
    """Build ``cls`` from a mapping, recursively, rejecting unknown keys."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(unknown_key_message(f"{prefix}{key}", [f"{prefix}{n}" for n in names]))
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if substitutions and f.name in substitutions:
                values[f.name] = substitutions[f.name]()
            continue
        field_type = (substitutions or {}).get(f.name, hints[f.name])
        values[f.name] = coerce(raw[f.name], field_type, f"{prefix}{f.name}")
    return cls(**values)


def coerce(value: Any, field_type: Any, key: str) -> Any:
    """Check/convert ``value`` to ``field_type`` with a message naming ``key``."""
    if dataclasses.is_dataclass(field_type):
        return build_dataclass(field_type, value, f"{key}.")
    origin = typing.get_origin(field_type)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item_type, *_) = typing.get_args(field_type) or (Any,)
        return [coerce(v, item_type, key) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        return value
    if field_type is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if field_type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if field_type is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if field_type is str:
        if isinstance(value, bool):
            return "true" if value else "false"  # YAML reads an unquoted true/false as a bool
        return "" if value is None else str(value)
    if field_type is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "1e-4" as a string
        except ValueError:
            pass
    if field_type in (int, float):
        raise ConfigError(f"{key} must be a number ({field_type.__name__}), got {value!r}")
    return value


def unknown_key_message(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return f"unknown config key {key!r}{hint}"


def all_keys(obj: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(all_keys(value, f"{prefix}{f.name}."))
    return keys


def set_dotted(cfg: Config, key: str, value: Any) -> None:
    """Set ``a.b.c`` on the nested dataclasses, with the same checks as the file."""
    parts = key.split(".")
    if parts[-1].isdigit():
        set_list_item(cfg, ".".join(parts[:-1]), int(parts[-1]), value)
        return
    target: Any = cfg
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
            raise ConfigError(unknown_key_message(key, all_keys(cfg)))
        if depth == len(parts) - 1:
            break
        target = getattr(target, part)
    name = parts[-1]
    field_type = typing.get_type_hints(type(target))[name]
    if key == "job.name":
        if value != cfg.job.name:
            raise ConfigError("job.name cannot change the job of a config file; use another config")
        return
    setattr(target, name, coerce(value, field_type, key))


def set_list_item(cfg: Config, key: str, index: int, value: Any) -> None:
    """``optim.betas.0=0.95``: one item of a list setting."""
    *path, name = key.split(".")
    target: Any = cfg
    for part in path:
        target = getattr(target, part, None)
    items = getattr(target, name, None) if dataclasses.is_dataclass(target) else None
    if not isinstance(items, list) or not 0 <= index < len(items):
        raise ConfigError(unknown_key_message(f"{key}.{index}", all_keys(cfg)))
    item_type = typing.get_args(typing.get_type_hints(type(target))[name])[0]
    items[index] = coerce(value, item_type, f"{key}.{index}")


# --------------------------------------------------------------------- dump
def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(data: dict[str, Any]) -> tuple[Config, Job]:
    """Rebuild a config (e.g. on a Ray worker) from :func:`to_dict` output."""
    job = load_job(data["job"]["name"])
    return build_dataclass(Config, data, "", {"job": job.config_class}), job
