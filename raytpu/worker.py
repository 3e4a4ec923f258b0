"""The Ray Train side of a run: what each worker does and how it reports to Ray.

The driver builds one :class:`WorkerPayload` (``raytpu.launcher``); ``TorchTrainer`` hands it
to :func:`train_worker_entry` on every worker as ``train_loop_config``, which builds the
runtime, the reporter and the :class:`~raytpu.loop.Trainer`, and runs it.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raytpu import checkpoint as ckpt
from raytpu.batch_finder import fit_finding_batch
from raytpu.checkpoint import Reporter, checkpoint_dirs
from raytpu.config import Config, from_dict
from raytpu.loop import Trainer
from raytpu.runtime import make_runtime


@dataclass
class WorkerPayload:
    """Everything a worker needs, built once on the driver (plain values: Ray pickles it)."""

    config: dict[str, Any]
    run_dir: str
    data_root: str
    mode: str  # train | test
    main_metric_mode: str  # max | min
    datasets: list[str] = field(default_factory=list)  # the Ray Datasets given to TorchTrainer
    stop_flag: str = ""  # name of the run's StopFlag actor ("" = none: a Tune trial)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class RayReporter(Reporter):
    """Reports and checkpoints through ``ray.train.report``; the run's latest checkpoint from Ray;
    stop requests from the driver's :class:`StopFlag` and Ray's preemption notices."""

    def __init__(self, run_dir: Path, rank: int = 0, stop_flag: str = "") -> None:
        self.run_dir, self.rank = run_dir, rank
        self.stop_flag = stop_flag
        self._restore: Any = None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        try:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        except OSError as exc:  # Ray copies the checkpoint into run.storage_path
            raise ckpt.CheckpointWriteError(exc.filename or self.run_dir / name, exc) from exc

    def latest_checkpoint(self) -> Path | None:
        import ray.train

        found = ray.train.get_checkpoint()
        if found is None:
            return None
        self._restore = found.as_directory()
        return Path(self._restore.__enter__())

    def interruption(self) -> str | None:
        """Rank 0 reads the stop flag, Ray Train agrees on a node drain (``get_preemption_info``);
        both answers travel from rank 0 to every rank through Ray Train's collectives."""
        import ray
        import ray.train
        from ray.train.collective import broadcast_from_rank_zero

        stop = False
        if self.rank == 0 and self.stop_flag:
            stop = ray.get(ray.get_actor(self.stop_flag).is_requested.remote(), timeout=60)
        preempted = ray.train.get_preemption_info() is not None
        if broadcast_from_rank_zero(stop):
            if self.rank == 0:
                ray.get(ray.get_actor(self.stop_flag).confirm.remote(), timeout=60)
            return "stop"
        return "preempted" if preempted else None

    def resume_candidates(self) -> list[Path]:
        """Ray's latest checkpoint, then the run folder's older ones (when it is a local folder)."""
        latest = self.latest_checkpoint()
        older = [p for p in checkpoint_dirs(self.run_dir) if latest is None or p.name != latest.name]
        return ([latest] if latest else []) + older


def train_worker_entry(config: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the TorchTrainer: one call per Ray worker."""
    import ray.train

    payload = WorkerPayload(**config)
    cfg, job = from_dict(payload.config)
    if not cfg.logging.verbose:
        quiet_reports()
    run_dir = Path(payload.run_dir)
    context = ray.train.get_context()
    cfg.xla.compile_cache = cfg.xla.compile_cache or str(run_dir / "xla_cache")
    if cfg.scaling.runtime == "xla" and cfg.scaling.tpu.accelerator_type and cfg.scaling.tpu.layout == "multiprocess":
        configure_chip_process(cfg, context.get_world_rank())
    runtime = make_runtime(
        cfg.scaling.runtime,
        cfg.scaling.precision,
        context.get_world_size(),
        context.get_world_rank(),
        context.get_local_rank(),
        cfg.xla,
    )
    reporter = RayReporter(run_dir, context.get_world_rank(), payload.stop_flag)
    datasets = {name: ray.train.get_dataset_shard(name) for name in payload.datasets}

    def trainer(cfg: Config) -> Trainer:
        return Trainer(cfg, job, runtime, run_dir, Path(payload.data_root), reporter, datasets)

    if payload.mode == "train":
        fit_finding_batch(cfg, runtime, run_dir, lambda cfg: trainer(cfg).fit())
        return
    metrics = trainer(cfg).test()
    with tempfile.TemporaryDirectory(prefix="raytpu-test-") as tmp:
        if runtime.is_main:
            ckpt.save_json(Path(tmp) / "test_metrics.json", metrics)
        reporter.report(metrics, Path(tmp) if runtime.is_main else None, "test")


def quiet_reports() -> None:
    """Ray Train 2.60 logs every report at INFO through a logger named by its source file, outside
    ``ray.train``, where ``RunConfig(logging_config=...)`` does not reach: set that logger's level."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def configure_chip_process(cfg: Config, world_rank: int) -> dict[str, str]:
    """Per-chip layout: give this process torch_xla's PJRT multi-process environment
    (before torch_xla is imported), from the slice spec and every worker's TPU worker id and
    host address (Ray does not order the hosts by worker id: ``raytpu.tpu.chip_process_env``)."""
    import ray
    import torch.distributed as dist

    from raytpu.tpu import apply_env, chip_process_env, slice_spec, tpu_worker_id

    spec = slice_spec(cfg.scaling.tpu.accelerator_type, cfg.scaling.tpu.topology)
    mine = (tpu_worker_id(ray.get_runtime_context().get_node_labels()), ray.util.get_node_ip_address())
    placements: list[tuple[int, str]] = [(0, "")] * dist.get_world_size()
    dist.all_gather_object(placements, mine)
    env = chip_process_env(world_rank, placements, spec)
    apply_env(env)
    return env
