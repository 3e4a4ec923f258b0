"""The driver side: connect to Ray, build a ``TorchTrainer`` from a config, run it.

Nothing here touches an accelerator: on a TPU VM the driver must not hold the
TPU that its workers need, so the runtime is decided from Ray's cluster
resources and resolved on the workers.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from pathlib import Path
from typing import Any

from raytpu.config import Config, ConfigError, dump_yaml, per_worker_batch, to_dict
from raytpu.job import Job
from raytpu.runtime import pick_runtime
from raytpu.tpu import check_num_workers, slice_spec, workers_for_layout

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
    if fallback.exists() and given != fallback:
        if given is not None:
            warnings.warn(f"data.path {str(given)!r} does not exist; using {str(fallback)!r}", stacklevel=2)
        return fallback.resolve()
    allow = cfg.data.synthesize_if_missing if synthesize is None else synthesize
    if allow:
        target = given or fallback
        print(f"raytpu: data not found; synthesizing a small {job.name} data set in {target}", flush=True)
        job.synthesize(target, **job.synth_options(cfg))
        return target.resolve()
    named = f"{str(given)!r} nor " if given is not None else ""
    raise ConfigError(
        f"no data: neither {named}{str(fallback)!r} exists; pass --data-path DIR, or make a synthetic set with "
        f"`raytpu data synth {job.name} --out {given or fallback}`"
    )


def run_name(cfg: Config, config_path: str | None) -> str:
    if cfg.run.name:
        return cfg.run.name
    stem = Path(config_path).stem if config_path else "run"
    return f"{cfg.job.name}-{stem}"


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.storage_path).resolve() / cfg.run.name


# --------------------------------------------------------------------- ray
def connect(address: str | None, quiet: bool = False) -> None:
    """Join the cluster at ``address`` / ``RAY_ADDRESS``, or start a local Ray instance."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    env = {"PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)}
    env["RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS"] = "0"
    kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "log_to_driver": not quiet}
    if address is None:
        print("raytpu: no Ray cluster given (--address / RAY_ADDRESS); starting a local Ray instance", flush=True)
    ray.init(address=address, **kwargs)


def cluster_runtime(requested: str) -> str:
    """Resolve ``auto`` from the cluster's resources (never by probing devices here)."""
    if requested != "auto":
        return requested
    import ray

    resources = ray.cluster_resources()
    return pick_runtime("auto", resources.get("TPU", 0) > 0, resources.get("GPU", 0) > 0)


def build_trainer(cfg: Config, payload: dict[str, Any], name: str, callbacks: list[Any] | None = None) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytpu.loop import train_worker_entry
    from raytpu.xla_backend import torch_config

    leave_cpu_for_ray_data(cfg)
    scaling = ScalingConfig(**scaling_kwargs(cfg))
    mode = payload["mode"]
    checkpoints = CheckpointConfig(
        num_to_keep=cfg.checkpoint.num_to_keep,
        checkpoint_score_attribute="score" if mode == "train" else None,
        checkpoint_score_order="max" if payload["main_metric_mode"] == "max" else "min",
    )
    run_config = RunConfig(
        name=name,
        storage_path=str(Path(cfg.run.storage_path).resolve()),
        checkpoint_config=checkpoints,
        failure_config=FailureConfig(max_failures=cfg.checkpoint.max_failures),
        callbacks=callbacks or [],
    )
    return TorchTrainer(
        train_worker_entry,
        train_loop_config=payload,
        scaling_config=scaling,
        torch_config=torch_config(cfg.scaling.runtime),
        run_config=run_config,
        **ray_datasets(cfg, payload),
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

    if cfg.data.loader != "ray":
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


def ray_datasets(cfg: Config, payload: dict[str, Any]) -> dict[str, Any]:
    """``TorchTrainer`` arguments of the Ray Data path (none for data.loader=torch); the
    workers learn the split names from ``payload["datasets"]``."""
    if cfg.data.loader != "ray":
        return {}
    from raytpu import ingest
    from raytpu.job import load_job

    datasets = ingest.read_datasets(cfg, load_job(cfg.job.name), payload["mode"])
    payload["datasets"] = sorted(datasets)
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
def train(cfg: Config, job: Job, address: str | None = None) -> dict[str, Any]:
    """Train through Ray and print where everything is; returns a summary."""
    per_worker_batch(cfg.data.global_batch_size, cfg.scaling.num_workers, cfg.loop.grad_accum)
    data_root = resolve_data_root(cfg, job)
    connect(address)
    cfg.scaling.runtime = cluster_runtime(cfg.scaling.runtime)
    directory = run_dir(cfg)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.yaml").write_text(dump_yaml(cfg))
    payload = make_payload(cfg, job, directory, data_root, "train")
    result = fit(build_trainer(cfg, payload, cfg.run.name))
    best = result.get_best_checkpoint("score", payload["main_metric_mode"]) if result.best_checkpoints else None
    summary = {
        "run_dir": str(directory),
        "tensorboard": str(directory / "tensorboard"),
        "latest_checkpoint": result.checkpoint.path if result.checkpoint else None,
        "best_checkpoint": best.path if best else None,
        "metrics": {k: v for k, v in (result.metrics or {}).items() if "/" in k},
    }
    print(f"run directory:     {summary['run_dir']}")
    print(f"config:            {directory / 'config.yaml'}")
    print(f"tensorboard:       tensorboard --logdir {summary['tensorboard']}")
    print(f"latest checkpoint: {summary['latest_checkpoint']}")
    print(f"best checkpoint:   {summary['best_checkpoint']}")
    print("final metrics:     " + json.dumps(summary["metrics"]), flush=True)
    return summary


def test(cfg: Config, job: Job, address: str | None = None) -> dict[str, float]:
    """Evaluate ``checkpoint.weights``; returns the test metrics."""
    if not cfg.checkpoint.weights:
        raise ConfigError(
            "test mode needs weights: pass --checkpoint PATH (or --weight-path / checkpoint.weights=PATH)"
        )
    if not Path(cfg.checkpoint.weights).exists():
        raise ConfigError(f"checkpoint {cfg.checkpoint.weights!r} not found; pass the path printed by `raytpu train`")
    data_root = resolve_data_root(cfg, job, synthesize=False)
    connect(address, quiet=True)
    cfg.scaling.runtime = cluster_runtime(cfg.scaling.runtime)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    directory = run_dir(cfg) / f"test-{stamp}"
    payload = make_payload(cfg, job, directory, data_root, "test")
    result = fit(build_trainer(cfg, payload, f"{cfg.run.name}/test-{stamp}"))
    metrics_file = Path(result.checkpoint.path) / "test_metrics.json"
    return json.loads(metrics_file.read_text())


def make_payload(cfg: Config, job: Job, directory: Path, data_root: Path, mode: str) -> dict[str, Any]:
    if cfg.checkpoint.weights and Path(cfg.checkpoint.weights).exists():
        cfg.checkpoint.weights = str(Path(cfg.checkpoint.weights).resolve())  # workers run in another directory
    if cfg.xla.compile_cache not in ("", "none"):
        cfg.xla.compile_cache = str(Path(cfg.xla.compile_cache).resolve())
    return {
        "config": to_dict(cfg),
        "run_dir": str(directory),
        "data_root": str(data_root),
        "mode": mode,
        "main_metric_mode": job.main_metric_mode,
    }


def fit(trainer: Any) -> Any:
    from ray.train import TrainingFailedError

    try:
        return trainer.fit()
    except TrainingFailedError as exc:
        raise RunFailed(root_cause(exc)) from exc


class RunFailed(RuntimeError):
    """A training run failed on a worker; the message is the worker's error."""


def root_cause(exc: BaseException) -> str:
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank, error = sorted(failures.items())[0]
        cause = error
        while getattr(cause, "cause", None) is not None:
            cause = cause.cause
        text = str(cause).strip().splitlines()
        return f"worker {rank}: {text[-1] if text else type(cause).__name__}"
    controller = getattr(exc, "controller_failure", None)
    return str(controller or exc).strip().splitlines()[-1]
