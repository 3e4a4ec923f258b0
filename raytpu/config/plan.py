"""The plan: a user's config, the command and what the cluster offers, made once into what every
worker runs, by one function (:func:`make_plan`).

The config says what the user asked (``scaling.runtime: auto``, ``--per_device_train_batch_size
4``, a relative data path); the :class:`Facts` say what the driver found before planning (the
command, the cluster's offer, the data); the plan says what happens: the runtime and each worker's
resources (``raytpu.runtime.placement``), the precision, absolute paths, the :class:`BatchPlan`,
the Ray Datasets. It is frozen and travels to the workers as plain values (:meth:`Plan.as_dict`).
Nothing changes a plan once made: a Tune trial or a batch the finder stepped down to is a new plan,
made by the same function from the user's config with the trial's values (:meth:`Plan.remade`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytpu.config.batching import BatchPlan, elastic_plans
from raytpu.config.loading import from_dict, to_dict, with_values
from raytpu.config.schema import Config
from raytpu.errors import ConfigError
from raytpu.job import job_by_value, take_job
from raytpu.runtime.kinds import compiles, kind_of, precision_reason
from raytpu.runtime.placement import ClusterOffer, NodeType, Placement, place
from raytpu.storage.filesystems import is_remote, join

#: Accelerate's ``mixed_precision`` names of raytpu's precisions (``raytpu launch``)
ACCELERATE_NAMES = {"fp32": "no", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}


@dataclass(frozen=True)
class ScriptPlan:
    """``raytpu launch``: the user's script and what its processes are told."""

    path: str
    args: tuple[str, ...] = ()
    working_dir: str = ""
    mixed_precision: str = ""  # Accelerate's name: no | fp16 | bf16 | fp8 (asked: the plan's); "": the script's own
    gradient_accumulation_steps: int = 1
    state: str = ""  # the name of the run's launch-state actor
    last_checkpoint: int = 0  # the highest checkpoint number the run folder held before this launch


@dataclass(frozen=True)
class Facts:
    """What the driver found before planning: the command, where it runs, the cluster, the data."""

    mode: str  # train | test | launch
    offer: ClusterOffer = field(default_factory=ClusterOffer)
    local: bool = False  # ``--local``: processes of this machine, no Ray
    where: str = ""  # where the workers run, in words (the run's first line)
    main_metric_mode: str = "min"
    data_root: str = ""
    data_words: str = ""  # the data in a message's words ("": data_root; a corpus: its files and tokens)
    split_sizes: tuple[tuple[str, int], ...] = ()  # samples in each split the driver checked
    text: bool = False  # text streamed by Ray Data: the training blocks come from its feeder (raytpu.corpus)
    name: str = ""  # the run's folder under run.storage_path ("": run.name; a test's: <run>/test-<time>)
    command: str = ""  # the id of the command that runs it (its part of the goodput record)
    started: float = 0.0  # when that command started (seconds since the epoch)
    stop: str = ""  # where a stop request is read (``raytpu.records.stop``); "" = never
    progress_board: str = ""  # the actor where rank 0 posts its bar for the driver to draw (a notebook's)
    script: ScriptPlan | None = None
    # the values the driver fixes from where it runs, kept for every plan remade from this one (a Tune
    # trial, a smaller batch, another size): local paths made absolute from its working folder, the
    # trackers' settings from its environment (:func:`driver_values`)
    anchors: tuple[tuple[str, Any], ...] = ()
    # xla where the cluster has no TPU runs on the CPU PJRT device: asked with PJRT_DEVICE=CPU on the driver
    xla_on_cpu: bool = field(default_factory=lambda: os.environ.get("PJRT_DEVICE", "").upper() == "CPU")


@dataclass(frozen=True)
class Plan:
    """One run, made: the config as it runs (runtime, precision and batches settled, paths
    absolute), the user's config it was made from, the facts, and what the driver says of it."""

    config: Config
    asked: Config
    facts: Facts
    placement: Placement
    batch: BatchPlan | None = None  # how the global batch splits (None for ``raytpu launch``: the script's own)
    datasets: tuple[str, ...] = ()  # the Ray Datasets given to the TorchTrainer (data.loader=ray)
    notes: tuple[str, ...] = ()  # what the driver says before the run: what auto chose, what differs

    @property
    def mode(self) -> str:
        return self.facts.mode

    @property
    def storage(self) -> str:
        """``run.storage_path`` (made absolute from the driver's working folder)."""
        return self.config.run.storage_path.rstrip("/")

    @property
    def name(self) -> str:
        """The run's folder in the storage: Ray Train's name of the run."""
        return self.facts.name or self.config.run.name

    @property
    def run_dir(self) -> str:
        return join(self.storage, self.name)

    @property
    def script(self) -> ScriptPlan | None:
        return self.facts.script

    def remade(self, values: Mapping[str, Any], **facts: Any) -> Plan:
        """The plan of the user's config with dotted keys changed (a Tune trial's values, the batch
        a finder stepped down to), and facts changed (the trial's command): :func:`make_plan`."""
        anchors = tuple((key, value) for key, value in self.facts.anchors if key not in values)
        remade = dataclasses.replace(self.facts, anchors=anchors, **facts)  # the values given win
        return make_plan(with_values(self.asked, values), remade)

    def at_size(self, workers: int, devices: int = 1) -> Plan:
        """This plan on ``workers`` workers, each driving ``devices`` (the size an elastic run's group
        got): the same global batch, with the accumulation steps that hold it at that size."""
        scaling = self.config.scaling
        if workers == scaling.num_workers:
            return self
        assert self.batch is not None
        batch = self.batch.sized(workers, devices)
        values = {
            "scaling.num_workers": workers,
            "loop.grad_accum": batch.grad_accum,
            "data.global_batch_size": batch.global_batch,
            "data.per_device_train_batch_size": 0,
        }
        if scaling.tpu.min_slices:  # the unit is a slice
            values["scaling.tpu.slices"] = workers // (scaling.num_workers // scaling.tpu.slices)
        return self.remade(values)

    def as_dict(self) -> dict[str, Any]:
        facts = dataclasses.asdict(self.facts)
        return {
            "config": to_dict(self.config),
            "asked": to_dict(self.asked),
            "facts": facts,
            "placement": dataclasses.asdict(self.placement),
            "batch": dataclasses.asdict(self.batch) if self.batch else None,
            "datasets": list(self.datasets),
            "notes": list(self.notes),
            "job_by_value": job_by_value(self.config.job.name),
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Plan:
        take_job(values.get("job_by_value", ""))
        facts = dict(values["facts"])
        offer = facts["offer"]
        facts["offer"] = ClusterOffer(
            nodes=tuple(offer["nodes"]),
            available=offer["available"],
            node_types=tuple(NodeType(**node_type) for node_type in offer["node_types"]),
            node_types_from=offer["node_types_from"],
            this_machine=offer["this_machine"],
        )
        facts["split_sizes"] = tuple(tuple(pair) for pair in facts["split_sizes"])
        facts["anchors"] = tuple(tuple(pair) for pair in facts["anchors"])
        script = facts["script"]
        facts["script"] = ScriptPlan(**{**script, "args": tuple(script["args"])}) if script else None
        placement = dict(values["placement"])
        placement["tpu_slice"] = tuple(placement["tpu_slice"])
        return cls(
            config=from_dict(values["config"])[0],
            asked=from_dict(values["asked"])[0],
            facts=Facts(**facts),
            placement=Placement(**placement),
            batch=BatchPlan(**values["batch"]) if values["batch"] else None,
            datasets=tuple(values["datasets"]),
            notes=tuple(values["notes"]),
        )


# ----------------------------------------------------------------- the one function
def make_plan(cfg: Config, facts: Facts) -> Plan:
    """The plan of ``cfg`` (the config as the user wrote it) for the command and cluster of
    ``facts``: placement, precision, resolved config, the batch checked against the data."""
    if not facts.anchors:
        facts = dataclasses.replace(facts, anchors=tuple(driver_values(cfg).items()))
    scaling = cfg.scaling
    slice_named = bool(scaling.tpu.accelerator_type)
    placement = place(
        scaling.runtime, scaling.num_workers, scaling.tpu.layout, slice_named, facts.offer, facts.xla_on_cpu
    )
    kind = kind_of(placement.runtime)
    precision, warning = kind.plan_precision(scaling.precision, facts.offer)
    offer = None if facts.local else facts.offer
    resolved = resolve_config(cfg, placement.runtime, precision, placement, dict(facts.anchors), offer)
    batches = {} if facts.mode == "launch" else batch_plans(resolved)
    batch = batches.get(resolved.scaling.num_workers)
    if batch is not None:
        batch.check_splits(facts.split_sizes, facts.data_words or facts.data_root)
    if facts.script is not None and facts.script.mixed_precision:  # asked with --mixed_precision
        script = dataclasses.replace(facts.script, mixed_precision=ACCELERATE_NAMES[precision])
        facts = dataclasses.replace(facts, script=script)
    notes = [f"scaling.runtime auto -> {placement.runtime}: {placement.why}"] if placement.why else []
    notes += [placement.note] if placement.note else []
    notes += [f"warning: {warning}"] if warning else []
    if scaling.precision == "auto" and kind.accelerator:
        notes.append(f"scaling.precision {precision_reason(placement.runtime, 'auto', precision)}")
    notes += cpu_note(cfg, resolved) + bucket_note(resolved) + elastic_note(resolved, batches)
    datasets = datasets_of(resolved, facts.mode, facts.text)
    return Plan(resolved, cfg, facts, placement, batch, datasets, tuple(notes))


def batch_plans(cfg: Config) -> dict[int, BatchPlan]:
    """How the global batch splits at each size the run may take (one, unless it is elastic)."""
    if worker_range(cfg):
        return elastic_plans(cfg, elastic_sizes(cfg), devices_per_worker(cfg))
    return {cfg.scaling.num_workers: BatchPlan.of(cfg)}


def elastic_note(cfg: Config, batches: Mapping[int, BatchPlan]) -> list[str]:
    """An elastic run's sizes and what each means for the batch: ``elastic, 1 to 2 workers: 2 x 4
    per worker; 1 x 4 per worker x 2 accumulation steps (global batch 8 at every size)``."""
    if len(batches) < 2:
        return []
    parts = []
    for workers, batch in sorted(batches.items(), reverse=True):
        steps = f" x {batch.grad_accum} accumulation steps" if batch.grad_accum > 1 else ""
        parts.append(f"{workers} x {batch.per_worker} per worker{steps}")
    sizes, total = f"{min(batches)} to {max(batches)} workers", cfg.data.global_batch_size
    return [f"elastic, {sizes}: {'; '.join(parts)} (global batch {total} at every size)"]


def worker_range(cfg: Config) -> tuple[int, int] | None:
    """``(smallest, largest)`` of an elastic run (``scaling.num_workers: MIN:MAX``); None for one size."""
    low, high = cfg.scaling.min_workers, cfg.scaling.num_workers
    return (low, high) if 0 < low < high else None


def datasets_of(cfg: Config, mode: str, text: bool = False) -> tuple[str, ...]:
    """The Ray Datasets a run's ``TorchTrainer`` is given: ``data.loader=ray``'s splits (of streamed
    ``text``, the eval split alone: the training blocks come from its feeder, ``raytpu.corpus``)."""
    if cfg.data.loader != "ray" or mode == "launch":
        return ()
    if text:
        return ("valid",) if mode == "train" else ("test",)
    return ("train", "valid") if mode == "train" else ("test",)


def leave_cpu_for_ray_data(cfg: Config, offer: ClusterOffer) -> dict[str, Any]:
    """data.loader=ray: Ray Data's read tasks need a free CPU. On a cluster whose workers would
    reserve every CPU (a 2-core machine with 2 workers), each worker reserves less."""
    if cfg.data.loader != "ray" or cfg.scaling.cpus_per_worker < 1:
        return {}
    total = offer.up("CPU")
    spare = total - cfg.scaling.num_workers * cfg.scaling.cpus_per_worker
    if spare >= 1 or total <= 1:
        return {}
    return {"scaling.cpus_per_worker": (total - 1) / cfg.scaling.num_workers}


def bucket_note(cfg: Config) -> list[str]:
    if cfg.data.loader != "ray" or not is_remote(cfg.data.path):
        return []
    return [f"data.path is a bucket: reading {cfg.job.name}'s parquet tables through Ray Data (data.loader=ray)"]


def cpu_note(asked: Config, resolved: Config) -> list[str]:
    if resolved.scaling.cpus_per_worker == asked.scaling.cpus_per_worker:
        return []
    return [
        f"data.loader=ray: leaving 1 CPU of the cluster to Ray Data (scaling.cpus_per_worker "
        f"{asked.scaling.cpus_per_worker:g} -> {resolved.scaling.cpus_per_worker:g})"
    ]


def resolve_config(
    cfg: Config,
    runtime: str,
    precision: str,
    placement: Placement | None = None,
    fixed: Mapping[str, Any] | None = None,
    offer: ClusterOffer | None = None,
) -> Config:
    """The config as it runs on ``runtime`` at ``precision`` (and ``placement``: its worker count and
    each worker's TPU), with the driver's ``fixed`` values: per-device batches turned into global
    ones, gradient checkpointing routed to the runtime's own; on a cluster (``offer``), a CPU left
    to Ray Data where the workers would take them all."""
    kind = kind_of(runtime)
    compiled = "true" if compiles(runtime, cfg.loop.compile) else "false"
    settled = {"scaling.runtime": runtime, "scaling.precision": precision, "loop.compile": compiled}
    cfg = with_values(cfg, {**(fixed or {}), **settled, **placed(cfg, placement), **kind.sharding(cfg, precision)})
    values: dict[str, Any] = per_device_batches(cfg)
    if getattr(cfg.job, "gradient_checkpointing", False) and (
        kind.checkpoints_units or cfg.sharding.strategy != "none"
    ):
        # the runtime checkpoints each sharded unit itself (a non-reentrant checkpoint inside each
        # FSDP2 unit's all-gather; torch_xla's on xla, whose CSE would merge a plain one back)
        values.update({"job.gradient_checkpointing": False, "sharding.activation_checkpointing": True})
    if offer is not None:
        values.update(leave_cpu_for_ray_data(cfg, offer))
    return with_values(cfg, values)


def devices_per_worker(cfg: Config) -> int:
    """The devices each worker splits its share of the batch over (a TPU host's chips under SPMD;
    one before ``auto`` has picked the runtime)."""
    return 1 if cfg.scaling.runtime == "auto" else kind_of(cfg.scaling.runtime).devices_per_worker(cfg)


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
    tpu, kind = cfg.scaling.tpu, kind_of(placement.runtime)
    if kind.accelerator == "TPU" and tpu.accelerator_type and (tpu.slices > 1 or tpu.min_slices):
        from raytpu.runtime.tpu import slice_spec, workers_for_layout

        spec = slice_spec(tpu.accelerator_type, tpu.topology)
        per_slice, _ = workers_for_layout(spec, kind.tpu_layout(tpu.layout))
        values.update(
            {"scaling.num_workers": tpu.slices * per_slice, "scaling.min_workers": tpu.min_slices * per_slice}
        )
    return values


def elastic_sizes(cfg: Config) -> list[int]:
    """The sizes an elastic run may take: every count of workers in its range, or of a TPU slice's
    workers when its unit is a slice (``scaling.tpu.slices: MIN:MAX``)."""
    low, high = worker_range(cfg) or (cfg.scaling.num_workers, cfg.scaling.num_workers)
    tpu = cfg.scaling.tpu
    named = tpu.accelerator_type and tpu.min_slices and cfg.scaling.runtime != "auto"
    by_slice = named and kind_of(cfg.scaling.runtime).accelerator == "TPU"
    step = high // tpu.slices if by_slice else 1
    return list(range(low, high + 1, step))


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
    """What TrainingArguments' "per device" counts: a worker, or a chip under SPMD, where each
    worker drives its host's chips (the runtime's description says)."""
    return kind_of(cfg.scaling.runtime).data_parallel_replicas(cfg)


def storage_of(cfg: Config) -> str:
    """``run.storage_path``: a bucket URI as it is, a local folder made absolute."""
    storage = cfg.run.storage_path
    return storage.rstrip("/") if is_remote(storage) else str(Path(storage).resolve())


def driver_values(cfg: Config) -> dict[str, Any]:
    """What the driver fixes from where it runs (:attr:`Facts.anchors`): the local paths the workers
    read made absolute as the command that names them means them (relative to where it runs: the
    run's storage, the weights or checkpoint to start from, XLA's compile cache), and the trackers' settings from
    its environment (:func:`tracking`)."""
    values: dict[str, Any] = {"run.storage_path": storage_of(cfg)}
    if cfg.checkpoint.weights and not is_remote(cfg.checkpoint.weights) and Path(cfg.checkpoint.weights).exists():
        values["checkpoint.weights"] = str(Path(cfg.checkpoint.weights).resolve())
    if cfg.checkpoint.resume_from and not is_remote(cfg.checkpoint.resume_from):
        values["checkpoint.resume_from"] = str(Path(cfg.checkpoint.resume_from).resolve())
    if cfg.xla.compile_cache not in ("", "none"):
        values["xla.compile_cache"] = str(Path(cfg.xla.compile_cache).resolve())
    return {**values, **tracking(cfg)}


def tracking(cfg: Config, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The trackers' settings as the workers use them (``logging.report_to``): the config's, else the
    trackers' own variables on the driver (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``,
    ``WANDB_PROJECT``, ``WANDB_MODE``), else the defaults: an SQLite file beside the runs of a local
    storage, the experiment ``raytpu``, W&B online."""
    log, values = cfg.logging, {}
    trackers = set(log.report_to)
    if trackers & {"mlflow", "wandb"} and not log.experiment:
        named = environ.get("MLFLOW_EXPERIMENT_NAME") if "mlflow" in trackers else None
        values["logging.experiment"] = named or environ.get("WANDB_PROJECT") or "raytpu"
    if "mlflow" in trackers and not log.mlflow_tracking_uri:
        values["logging.mlflow_tracking_uri"] = environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(cfg)
    if "wandb" in trackers and not log.wandb_mode:
        values["logging.wandb_mode"] = environ.get("WANDB_MODE") or "online"
    return values


def default_tracking_uri(cfg: Config) -> str:
    """An SQLite store in a local ``run.storage_path`` (every run under it in one database, as
    ``mlflow ui --backend-store-uri`` reads it); a bucket has no such file: a server is needed."""
    storage = storage_of(cfg)
    if is_remote(storage):
        raise ConfigError(
            f"logging.report_to has mlflow and run.storage_path={storage} is a bucket: set MLFLOW_TRACKING_URI "
            "(or logging.mlflow_tracking_uri) to a tracking server every node reaches"
        )
    return f"sqlite:///{storage}/mlflow.db"
