"""The driver side: connect to Ray, build a ``TorchTrainer`` from a config, run it.

Nothing here touches an accelerator: on a TPU VM the driver must not hold the
TPU that its workers need, so the runtime is decided from Ray's cluster
resources and resolved on the workers.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytpu import preflight
from raytpu.batch_finder import ray_max_failures, recorded_text
from raytpu.cluster import check_reachable, connect
from raytpu.config import Config, ConfigError, dump_yaml, to_dict
from raytpu.errors import RunFailed, RunStopped
from raytpu.job import Job
from raytpu.runtime import pick_runtime
from raytpu.tpu import check_num_workers, slice_spec, workers_for_layout
from raytpu.validation import resolve_for_runtime
from raytpu.worker import WorkerPayload

os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")


# ------------------------------------------------------------------- paths
def resolve_data_root(cfg: Config, job: Job, synthesize: bool | None = None) -> Path:
    """``data.path`` if it exists, else ``./data/<job>`` (with a warning), else
    synthesize it when the config allows, else one error naming both."""
    if cfg.data.loader == "ray":
        return prepared_root(cfg, job)
    fallback = Path("data") / job.name
    given = Path(cfg.data.path) if cfg.data.path else None
    if given is not None and given.exists():
        return given.resolve()
    allow = cfg.data.synthesize_if_missing if synthesize is None else synthesize
    if allow and given is not None:  # the set asked for, made with this run's seed: not another one
        return synthesize_data(cfg, job, given)
    if fallback.exists() and given != fallback:
        if given is not None:
            warnings.warn(f"data.path {str(given)!r} does not exist; using {str(fallback)!r}", stacklevel=2)
        return fallback.resolve()
    if allow:
        return synthesize_data(cfg, job, fallback)
    named = f"{str(given)!r} nor " if given is not None else ""
    raise ConfigError(
        f"no data: neither {named}{str(fallback)!r} exists; pass --data-path DIR, or make a synthetic set with "
        f"`raytpu data synth {job.name} --out {given or fallback}`"
    )


def synthesize_data(cfg: Config, job: Job, target: Path) -> Path:
    print(f"raytpu: data not found; synthesizing a small {job.name} data set in {target}", flush=True)
    job.synthesize(target, **job.synth_options(cfg))
    return target.resolve()


def run_name(cfg: Config, config_path: str | None) -> str:
    if cfg.run.name:
        return cfg.run.name
    stem = Path(config_path).stem if config_path else "run"
    return f"{cfg.job.name}-{stem}"


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.storage_path).resolve() / cfg.run.name


# --------------------------------------------------------------------- ray
def cluster_accelerators() -> dict[str, float]:
    import ray

    resources = ray.cluster_resources()
    return {kind: resources.get(kind, 0) for kind in ("TPU", "GPU")}


def cluster_runtime(requested: str, accelerators: dict[str, float]) -> str:
    """Resolve ``auto`` from the cluster's :func:`cluster_accelerators` (never by probing devices here)."""
    return pick_runtime(requested, accelerators["TPU"] > 0, accelerators["GPU"] > 0)


def check_sharded_workers(cfg: Config, accelerators: dict[str, float]) -> None:
    """FSDPv2 across several xla workers needs XLA collectives between them (TPU hosts, GPUs).
    Workers on the CPU PJRT device have none: their sharded gradients would be gathered to
    the host for gloo, a new graph per gradient at every step, until LLVM runs out of memory."""
    xla = cfg.xla
    sharded = cfg.scaling.runtime == "xla" and xla.spmd and xla.mesh.fsdp != 1
    if not sharded or cfg.scaling.num_workers == 1 or any(accelerators.values()):
        return
    raise ConfigError(
        f"FSDPv2 (xla.mesh.fsdp={xla.mesh.fsdp}) over {cfg.scaling.num_workers} workers of the CPU PJRT device: "
        "they share no XLA collectives; run scaling.num_workers=1, which drives all CPU_NUM_DEVICES devices"
    )


def worker_bundles(cfg: Config) -> list[preflight.Bundle]:
    """One resource bundle per worker, as the run's ``TorchTrainer`` reserves them."""
    return [preflight.worker_bundle(scaling_kwargs(cfg))] * cfg.scaling.num_workers


def check_cluster_fits(cfg: Config) -> None:
    """After connecting: the runtime resolved, a CPU left to Ray Data, and the workers checked against
    the cluster (a demand it can never meet is a one-line error, not a wait)."""
    accelerators = cluster_accelerators()
    cfg.scaling.runtime = cluster_runtime(cfg.scaling.runtime, accelerators)
    check_sharded_workers(cfg, accelerators)
    resolve_for_runtime(cfg)
    leave_cpu_for_ray_data(cfg)
    what = f"{cfg.scaling.num_workers} {cfg.scaling.runtime} worker(s)"
    preflight.check_fit(worker_bundles(cfg), what)


def where_it_runs(cfg: Config, cluster: str) -> str:
    """One line: the cluster, the workers, the runtime and precision, and the batch per worker."""
    from raytpu.runtime.base import resolve_precision

    precision, _ = resolve_precision(cfg.scaling.runtime, cfg.scaling.precision)
    share = cfg.data.global_batch_size // (cfg.scaling.num_workers * cfg.loop.grad_accum)
    accum = f" x {cfg.loop.grad_accum} accumulation steps" if cfg.loop.grad_accum > 1 else ""
    return (
        f"raytpu: {cfg.run.mode} {cfg.run.name} on {cluster}: {cfg.scaling.num_workers} {cfg.scaling.runtime} "
        f"worker(s), {precision}, {share} samples per worker{accum} (global batch {cfg.data.global_batch_size})"
    )


def build_trainer(cfg: Config, payload: WorkerPayload, name: str, callbacks: list[Any] | None = None) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytpu.worker import train_worker_entry
    from raytpu.xla_backend import torch_config

    scaling = ScalingConfig(**scaling_kwargs(cfg))
    datasets = ray_datasets(cfg, payload.mode)
    payload = dataclasses.replace(payload, datasets=sorted(datasets.get("datasets", {})))
    checkpoints = CheckpointConfig(
        num_to_keep=cfg.checkpoint.num_to_keep,
        checkpoint_score_attribute="score" if payload.mode == "train" else None,
        checkpoint_score_order="max" if payload.main_metric_mode == "max" else "min",
    )
    run_config = RunConfig(
        name=name,
        storage_path=str(Path(cfg.run.storage_path).resolve()),
        checkpoint_config=checkpoints,
        failure_config=FailureConfig(max_failures=ray_max_failures(cfg)),
        # Ray Train's own per-report, per-checkpoint and scheduling lines: shown with --verbose
        logging_config=LoggingConfig(log_level="INFO" if cfg.logging.verbose else "WARNING"),
        callbacks=callbacks or [],
    )
    return TorchTrainer(
        train_worker_entry,
        train_loop_config=payload.as_dict(),
        scaling_config=scaling,
        torch_config=torch_config(cfg.scaling.runtime, cfg.logging.verbose),
        run_config=run_config,
        **datasets,
    )


def prepared_root(cfg: Config, job: Job) -> Path:
    """data.loader=ray: ``data.path`` must hold tables made by ``raytpu data prepare`` (a local
    folder or a filesystem URI, which the workers read as it is); never synthesized."""
    from raytpu import ingest

    return Path(ingest.prepared_location(cfg, job))


def leave_cpu_for_ray_data(cfg: Config) -> None:
    """data.loader=ray: Ray Data's read tasks need a free CPU. On a cluster whose workers
    would reserve every CPU (a 2-core machine with 2 workers), reserve less per worker."""
    import ray

    if cfg.data.loader != "ray" or cfg.scaling.cpus_per_worker < 1:
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    spare = total - cfg.scaling.num_workers * cfg.scaling.cpus_per_worker
    if spare >= 1 or total <= 1:
        return
    share = (total - 1) / cfg.scaling.num_workers
    print(
        f"raytpu: data.loader=ray: leaving 1 of the cluster's {total:g} CPUs to Ray Data "
        f"(scaling.cpus_per_worker {cfg.scaling.cpus_per_worker:g} -> {share:g})",
        flush=True,
    )
    cfg.scaling.cpus_per_worker = share


def ray_datasets(cfg: Config, mode: str) -> dict[str, Any]:
    """``TorchTrainer`` arguments of the Ray Data path (none for data.loader=torch)."""
    if cfg.data.loader != "ray":
        return {}
    from raytpu import ingest
    from raytpu.job import load_job

    datasets = ingest.read_datasets(cfg, load_job(cfg.job.name), mode)
    return {"datasets": datasets, "dataset_config": ingest.dataset_config()}


def scaling_kwargs(cfg: Config) -> dict[str, Any]:
    """``ScalingConfig`` arguments. On a TPU slice (``scaling.tpu.accelerator_type``
    set) Ray gang-schedules the whole slice: one worker per host (spmd) or per
    chip (multiprocess), checked against ``num_workers`` here."""
    resources = {"CPU": cfg.scaling.cpus_per_worker, **cfg.scaling.resources_per_worker}
    kwargs: dict[str, Any] = {
        "num_workers": cfg.scaling.num_workers,
        "use_gpu": cfg.scaling.runtime == "cuda",
        "resources_per_worker": resources,
    }
    tpu = cfg.scaling.tpu
    if cfg.scaling.runtime == "xla" and tpu.accelerator_type:
        spec = slice_spec(tpu.accelerator_type, tpu.topology)
        check_num_workers(spec, tpu.layout, cfg.scaling.num_workers)
        _, tpu_resources = workers_for_layout(spec, tpu.layout)
        kwargs.update(
            use_tpu=True,
            topology=spec.topology,
            accelerator_type=spec.accelerator_type,
            resources_per_worker={**resources, **tpu_resources},
        )
    return kwargs


# -------------------------------------------------------------------- runs
def check_before_start(cfg: Config, job: Job, mode: str, address: str | None) -> Path:
    """Everything checked on the driver before a worker starts or a file is written; the data root."""
    check_reachable(address or os.environ.get("RAY_ADDRESS") or None)
    data_root = check_files(cfg, job, mode)
    connect(address, quiet=mode == "test", verbose=cfg.logging.verbose)
    check_cluster_fits(cfg)
    if cfg.data.per_device_train_batch_size:  # the global batch is known only now
        preflight.check_data(cfg, job, data_root, mode)
    address = address or os.environ.get("RAY_ADDRESS")
    print(where_it_runs(cfg, f"the Ray cluster at {address}" if address else "the local Ray instance"), flush=True)
    return data_root


def check_files(cfg: Config, job: Job, mode: str) -> Path:
    """The checks that need no cluster: storage, weights, data (made first when the config says so)."""
    preflight.check_storage(cfg)
    preflight.check_weights(cfg)
    data_root = resolve_data_root(cfg, job, synthesize=None if mode == "train" else False)
    preflight.check_data(cfg, job, data_root, mode)
    return data_root


def local_runtime(requested: str) -> str:
    """``auto`` resolved on this machine for ``--local`` (device files for a TPU, never torch_xla)."""
    import torch

    from raytpu.runtime import tpu_present

    runtime = pick_runtime(requested, tpu_present(), torch.cuda.is_available())
    if runtime == "cuda" and not torch.cuda.is_available():
        raise ConfigError("scaling.runtime=cuda but this machine has no GPU; use scaling.runtime=auto (or cpu)")
    return runtime


@dataclass(frozen=True)
class RunPlan:
    """A run ready to start: its folder, its Ray Train name and the workers' payload."""

    directory: Path
    name: str
    payload: WorkerPayload


def prepare_run(cfg: Config, job: Job, mode: str, address: str | None) -> RunPlan:
    """The one driver preparation step of ``train`` and ``test`` (and, once per sweep, ``tune``):
    every check, the cluster joined and the runtime resolved from it, paths made absolute, then
    the run's folder with its saved config and the payload each worker receives."""
    data_root = check_before_start(cfg, job, mode, address)
    if mode == "train":
        return stage_run(cfg, job, run_dir(cfg), data_root, cfg.run.name)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return stage_run(cfg, job, run_dir(cfg) / f"test-{stamp}", data_root, f"{cfg.run.name}/test-{stamp}", "test")


def stage_run(cfg: Config, job: Job, directory: Path, data_root: Path, name: str, mode: str = "train") -> RunPlan:
    """The run's folder (with ``config.yaml`` for training) and the workers' payload (a Tune trial
    calls this alone: its sweep did the checks)."""
    if mode == "train":
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.yaml").write_text(dump_yaml(cfg))
    return RunPlan(directory, name, make_payload(cfg, job, directory, data_root, mode))


def train(cfg: Config, job: Job, address: str | None = None, local: bool = False) -> dict[str, Any]:
    """Train through Ray (or, with ``local``, in local processes) and print where everything is;
    returns a summary."""
    summary = train_local(cfg, job) if local else train_on_ray(cfg, job, address)
    print_summary(summary, recorded_text(Path(summary["run_dir"]), cfg.data.global_batch_size))
    if summary.get("stopped_by"):
        signum = summary["stopped_by"]
        raise RunStopped(
            signum,
            f"stopped by {signal.Signals(signum).name} after checkpointing step {summary['metrics_step']}; "
            "run the same command again to resume from there",
        )
    return summary


def print_summary(summary: dict[str, Any], found_batch: str | None = None) -> None:
    """``found_batch``: the batch ``loop.auto_find_batch_size`` stepped down to, if it did."""
    print(f"run directory:     {summary['run_dir']}")
    print(f"config:            {Path(summary['run_dir']) / 'config.yaml'}")
    if found_batch:
        print(f"batch size:        {found_batch}, found by auto_find_batch_size")
    print(f"tensorboard:       tensorboard --logdir {summary['tensorboard']}")
    print(f"latest checkpoint: {summary['latest_checkpoint']}")
    print(f"best checkpoint:   {summary['best_checkpoint']}")
    print("final metrics:     " + json.dumps(summary["metrics"]), flush=True)


def train_on_ray(cfg: Config, job: Job, address: str | None) -> dict[str, Any]:
    from raytpu.stopping import StopOnSignal

    plan = prepare_run(cfg, job, "train", address)
    with StopOnSignal() as stop:
        payload = dataclasses.replace(plan.payload, stop_flag=stop.name)
        result = fit(build_trainer(cfg, payload, plan.name))
    best = result.get_best_checkpoint("score", plan.payload.main_metric_mode) if result.best_checkpoints else None
    return {
        "stopped_by": stop.stopped_by(),
        "metrics_step": (result.metrics or {}).get("step"),
        "run_dir": str(plan.directory),
        "tensorboard": str(plan.directory / "tensorboard"),
        "latest_checkpoint": result.checkpoint.path if result.checkpoint else None,
        "best_checkpoint": best.path if best else None,
        "metrics": {k: v for k, v in (result.metrics or {}).items() if "/" in k},
    }


def train_local(cfg: Config, job: Job) -> dict[str, Any]:
    """``raytpu train --local``: the checks, then ``raytpu.local`` (no Ray)."""
    from raytpu import local

    local.check_local(cfg)
    cfg.scaling.runtime = local_runtime(cfg.scaling.runtime)
    resolve_for_runtime(cfg)
    data_root = check_files(cfg, job, "train")
    absolute_paths(cfg)
    return local.train(cfg, job, data_root, run_dir(cfg))


def test(cfg: Config, job: Job, address: str | None = None) -> dict[str, float]:
    """Evaluate ``checkpoint.weights``; returns the test metrics."""
    if not cfg.checkpoint.weights:
        raise ConfigError(
            "test mode needs weights: pass --checkpoint PATH (or --weight-path / checkpoint.weights=PATH)"
        )
    plan = prepare_run(cfg, job, "test", address)
    result = fit(build_trainer(cfg, plan.payload, plan.name))
    metrics_file = Path(result.checkpoint.path) / "test_metrics.json"
    return json.loads(metrics_file.read_text())


def absolute_paths(cfg: Config) -> None:
    """Paths the workers read, made absolute: they run in another directory."""
    if cfg.checkpoint.weights and Path(cfg.checkpoint.weights).exists():
        cfg.checkpoint.weights = str(Path(cfg.checkpoint.weights).resolve())
    if cfg.xla.compile_cache not in ("", "none"):
        cfg.xla.compile_cache = str(Path(cfg.xla.compile_cache).resolve())


def make_payload(cfg: Config, job: Job, directory: Path, data_root: Path, mode: str) -> WorkerPayload:
    absolute_paths(cfg)
    return WorkerPayload(to_dict(cfg), str(directory), str(data_root), mode, job.main_metric_mode)


def fit(trainer: Any) -> Any:
    from ray.train import TrainingFailedError

    try:
        return trainer.fit()
    except TrainingFailedError as exc:
        summary, details = root_cause(exc)
        raise RunFailed(summary, details) from exc


def root_cause(exc: BaseException) -> tuple[str, str]:
    """``("rank N: last line of the error", the failing rank's traceback)`` of a failed run."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank, error = sorted(failures.items())[0]
        cause = error
        while getattr(cause, "cause", None) is not None:
            cause = cause.cause
        text = str(error).strip()
        lines = str(cause).strip().splitlines()
        return f"rank {rank}: {lines[-1] if lines else type(cause).__name__}", text
    controller = getattr(exc, "controller_failure", None)
    text = str(controller or exc).strip()
    return f"run failed: {text.splitlines()[-1] if text else type(exc).__name__}", text
