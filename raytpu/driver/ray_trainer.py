"""The one ``TorchTrainer`` builder: every Ray run (``train``, ``test``, a Tune trial, ``launch``)
is a plan handed to :func:`raytpu.worker.entry.ray_entry` on its workers.

Nothing here touches an accelerator: on a TPU VM the driver must not hold the TPU its workers
need. What the trainer reserves (``ScalingConfig``), keeps (``CheckpointConfig``: the plan's
retention rule, ``raytpu.worker.reporting``) and retries (``FailureConfig``) all come from the plan.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

from raytpu.config import Config
from raytpu.config.plan import Plan, batch_plans, worker_range
from raytpu.errors import RunFailed, error_line, fixable_line
from raytpu.records.batches import ray_max_failures
from raytpu.records.checkpoints import full_disk_in
from raytpu.runtime.kinds import kind_of
from raytpu.runtime.placement import Bundle, ClusterOffer
from raytpu.storage.filesystems import filesystem, is_remote

#: Ray Train's resize monitor of an elastic run, which raytpu leaves idle: it would stop a growing
#: group's workers wherever they are; raytpu grows it at a checkpoint (``raytpu.cluster.elastic``)
NEVER_S = 10.0**9


def scaling_kwargs(cfg: Config) -> dict[str, Any]:
    """``ScalingConfig`` arguments: the worker count (an elastic run's range), and what each worker
    asks for as its runtime's description says (a GPU; a TPU host's or chip's chips, or a whole
    slice Ray gang-schedules, checked against ``num_workers``)."""
    resources = {"CPU": cfg.scaling.cpus_per_worker, **cfg.scaling.resources_per_worker}
    sizes = worker_range(cfg)
    kwargs: dict[str, Any] = {"num_workers": sizes or cfg.scaling.num_workers}
    if sizes:  # Ray restarts the group at what fits after a loss; raytpu grows it at checkpoints
        kwargs["elastic_resize_monitor_interval_s"] = NEVER_S
    return {**kwargs, **kind_of(cfg.scaling.runtime).scaling(cfg, resources)}


def worker_bundles(cfg: Config, smallest: bool = False) -> list[Bundle]:
    """One resource bundle per worker, as the run's ``TorchTrainer`` reserves them (``smallest``: of
    an elastic run's smallest size, which it starts with)."""
    kwargs = scaling_kwargs(cfg)
    bundle = {name: float(amount) for name, amount in kwargs["resources_per_worker"].items() if amount}
    if kwargs["use_gpu"]:
        bundle.setdefault("GPU", 1.0)
    sizes = worker_range(cfg)
    return [bundle] * (sizes[0] if sizes and smallest else cfg.scaling.num_workers)


def workers_text(cfg: Config, smallest: bool = False) -> str:
    """``2 cpu worker(s)``, or of an elastic run ``1 to 2 cpu worker(s)`` (``smallest``: its smallest size)."""
    sizes = worker_range(cfg)
    count = (f"{sizes[0]}" if smallest else f"{sizes[0]} to {sizes[1]}") if sizes else f"{cfg.scaling.num_workers}"
    return f"{count} {cfg.scaling.runtime} worker(s)"


#: Ray Train's switch of its preemption watcher: an actor for each worker group that polls Ray for
#: nodes being drained (a spot VM reclaimed), so that the group stops before they go
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
#: whether raytpu set :data:`PREEMPTION_WATCHER` (never a value the user set)
_WATCHER_SET: list[bool] = [False]


def drains_nodes(offer: ClusterOffer) -> bool:
    """Whether a node of the cluster can be drained while a run lives on it: where there are several,
    or an autoscaler that starts (and reclaims) more, or the nodes are not known. One node and no
    autoscaler (raytpu's local instance, one machine) has none to drain but the one the run is on."""
    return len(offer.nodes) != 1 or bool(offer.node_types)


def watch_preemption(offer: ClusterOffer) -> None:
    """Ray Train's preemption watcher only where a node can be drained (:func:`drains_nodes`):
    elsewhere it is a process of its own for each run, seconds of CPU starting, that has nothing to
    watch. Set in this process's environment, which Ray Train passes on to the controller of the
    trainer built next (in a Tune trial, the trial's); the user's own setting stays."""
    if PREEMPTION_WATCHER in os.environ and not _WATCHER_SET[0]:
        return
    if drains_nodes(offer):
        os.environ.pop(PREEMPTION_WATCHER, None)
        _WATCHER_SET[0] = False
    else:
        os.environ[PREEMPTION_WATCHER] = "0"
        _WATCHER_SET[0] = True


def build_trainer(plan: Plan, callbacks: list[Any] | None = None) -> Any:
    """A ``TorchTrainer`` that runs ``plan`` on its workers (with the Ray Datasets of
    ``data.loader=ray``, whose names the workers' plan then lists)."""
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raytpu.worker.entry import ray_entry

    cfg = plan.config
    watch_preemption(plan.facts.offer)
    datasets = ray_datasets(plan)
    scored = plan.mode == "train"
    checkpoints = CheckpointConfig(
        num_to_keep=cfg.checkpoint.num_to_keep,
        checkpoint_score_attribute="score" if scored else None,
        checkpoint_score_order="max" if plan.facts.main_metric_mode == "max" else "min",
    )
    failures = ray_max_failures(cfg) if plan.mode == "train" else cfg.checkpoint.max_failures
    callbacks = list(callbacks or [])
    sizes = worker_range(cfg)
    if sizes:  # losses and growths are retried without limit; the watch keeps the failure budget
        from raytpu.cluster.elastic import ElasticWatch

        accumulation = {workers: batch.grad_accum for workers, batch in batch_plans(cfg).items()}
        limit, global_batch = cfg.scaling.node_start_timeout_s, cfg.data.global_batch_size
        planned = plan.batch.workers if plan.batch else max(accumulation)
        watch = ElasticWatch(plan.run_dir, plan.facts.command, accumulation, planned, global_batch, failures, limit)
        callbacks.append(watch)
        failures = -1
    run_config = RunConfig(
        name=plan.name,
        **ray_storage(plan.storage),
        checkpoint_config=checkpoints,
        failure_config=FailureConfig(max_failures=failures),
        # Ray Train's own per-report, per-checkpoint and scheduling lines: shown with --verbose
        logging_config=LoggingConfig(log_level="INFO" if cfg.logging.verbose else "WARNING"),
        callbacks=callbacks,
    )
    return trainer_class(TorchTrainer)(
        ray_entry,
        train_loop_config=plan.as_dict(),
        scaling_config=ScalingConfig(**scaling_kwargs(cfg)),
        torch_config=kind_of(cfg.scaling.runtime).torch_config(cfg.logging.verbose),
        run_config=run_config,
        **datasets,
    )


@functools.cache
def trainer_class(torch_trainer: type) -> type:
    """Ray Train's ``TorchTrainer`` without the controller callbacks that have nothing to do in the run
    (:func:`idle_callbacks`). Each starts an actor of its own for every run (about 2-3 s of CPU on
    a small machine, importing Ray Train); ``tests/test_integration_ray.py`` checks that a run on
    a dashboard-less instance starts neither, so that a Ray upgrade that moves them fails a test."""

    class Trainer(torch_trainer):
        def _create_default_callbacks(self) -> list[Any]:
            idle = idle_callbacks(bool(self.datasets))
            return [callback for callback in super()._create_default_callbacks() if not isinstance(callback, idle)]

    Trainer.__name__ = Trainer.__qualname__ = torch_trainer.__name__
    return Trainer


def idle_callbacks(has_datasets: bool) -> tuple[type, ...]:
    """The default callbacks of a ``TorchTrainer`` that would idle: its datasets' (an actor that
    hands out Ray Dataset shards) in a run without Ray Datasets, and its placement-group cleaner's
    (an actor that asks Ray's state API whether the run's controller is alive, to remove the
    group of one that died) on a cluster without the state API, where it could never tell."""
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from raytpu.cluster.connect import serves_state_api

    idle: list[type] = [] if has_datasets else [DatasetsCallback]
    if serves_state_api() is False:
        idle.append(PlacementGroupCleanerCallback)
    return tuple(idle)


def ray_storage(storage: str) -> dict[str, Any]:
    """``RunConfig``'s storage: a local folder as it is; a bucket as raytpu's filesystem of it (its
    credentials and endpoints read as the clouds' tools read them: ``raytpu.storage.filesystems``)
    and the path in it."""
    if not is_remote(storage):
        return {"storage_path": storage}
    fs, path = filesystem(storage)
    return {"storage_path": path, "storage_filesystem": fs}


def ray_datasets(plan: Plan) -> dict[str, Any]:
    """``TorchTrainer`` arguments of the Ray Data path (none for data.loader=torch)."""
    cfg = plan.config
    if not plan.datasets:
        return {}
    from ray.train import DataConfig

    from raytpu.corpus.feeder import feeder_name
    from raytpu.corpus.prepare import text_datasets
    from raytpu.job import load_job

    if plan.facts.text:
        feeder = feeder_name(plan.facts.command, cfg.run.name)
        return text_datasets(cfg, load_job(cfg.job.name), Path(plan.facts.data_root), plan.mode, feeder)

    datasets = read_datasets(cfg, load_job(cfg.job.name), plan.mode)
    # only the train set is split over the workers; eval sets are read whole (raytpu.storage.tables)
    return {"datasets": datasets, "dataset_config": DataConfig(datasets_to_split=["train"])}


def read_datasets(cfg: Config, job: Any, mode: str) -> dict[str, Any]:
    """The Ray Datasets of a run: ``train`` and ``valid``, or ``test``.

    Eval sets are materialized here, once, into the object store: every worker reads them whole
    at every eval, and re-running the read tasks each time would cost more than the eval itself
    on small sets. The train set is materialized too when it is small (:func:`materialize_train`)
    and then shuffled globally at every epoch (``random_shuffle``); a larger one streams from
    storage, a fresh read per epoch with its files shuffled.
    """
    from raytpu.storage.tables import open_prepared

    prepared = open_prepared(cfg.data.path, job.name)
    datasets = {}
    for split in ("train", "valid") if mode == "train" else ("test",):
        datasets[split] = read_split(cfg, job, prepared, split)
    return datasets


def read_split(cfg: Config, job: Any, prepared: Any, split: str) -> Any:
    """One split's Ray Dataset (:func:`read_datasets`)."""
    import ray.data

    from raytpu.job import table_for

    table = table_for(job, cfg, split)
    paths = prepared.paths(table)
    if split != "train" or materialize_train(cfg, prepared, table):
        dataset = ray.data.read_parquet(paths, filesystem=prepared.fs).materialize()
        if split == "train" and cfg.data.shuffle:
            dataset = dataset.random_shuffle()
    else:
        shuffle = "files" if cfg.data.shuffle else None
        dataset = ray.data.read_parquet(paths, filesystem=prepared.fs, shuffle=shuffle)
    dataset.context.enable_progress_bars = False  # per-operator bars on every worker flood the run's log
    return dataset


def materialize_train(cfg: Config, prepared: Any, table: str) -> bool:
    """Whether the train set is read once into the object store: when it holds at most
    ``data.materialize_mb`` and a quarter of the cluster's object store (an epoch's shuffle holds
    a second copy). Each epoch then starts in milliseconds instead of the ~1 s a streaming read
    takes to deliver its first block, which on small data sets is a large share of an epoch."""
    import ray

    size = prepared.table_bytes(table)
    store = ray.cluster_resources().get("object_store_memory", 0.0)
    return size <= cfg.data.materialize_mb * 2**20 and size <= store / 4


def fit(trainer: Any) -> Any:
    """``trainer.fit()`` in a thread of its own while this one waits. Called from the main thread,
    Ray Train's ``fit()`` puts in a SIGINT handler of its own and leaves it there: Ctrl-C aborted
    the run at once instead of reaching raytpu's handler (:mod:`raytpu.driver.signals`: checkpoint,
    stop, resume), and after the run the handler held its controller actor alive in a process that
    went on (a notebook, the test suite). Without a handler of raytpu's (``raytpu test``,
    ``raytpu launch``), Ctrl-C interrupts the command, which stops the Ray instance it started."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # raised again in the waiting thread
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="raytpu-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    error = outcome.pop("error", None)
    if error is None:
        return outcome["result"]
    try:
        raise error
    finally:
        del error  # no cycle through this frame: the run's objects go with the exception


def wait_for_workers(plan: Plan) -> None:
    """When the plan's workers need nodes that the cluster's autoscaler has yet to start, or
    resources other work holds, wait for them before the ``TorchTrainer`` starts
    (:func:`raytpu.cluster.capacity.wait_for_nodes`: what it waits for, and a limit), instead of
    Ray Train's silent wait, which has no limit."""
    from raytpu.cluster.capacity import read_offer, wait_for_nodes
    from raytpu.cluster.connect import joined_here
    from raytpu.runtime.placement import judge_fit

    cfg = plan.config
    offer = read_offer(this_machine=joined_here())
    bundles = worker_bundles(cfg, smallest=True)  # an elastic run starts once its smallest size fits
    what = workers_text(cfg, smallest=True)
    verdict = judge_fit(bundles, offer, what).verdict
    if verdict in ("later", "busy"):
        wait_for_nodes(bundles, what, cfg.scaling.node_start_timeout_s, offer, held_by_others=verdict == "busy")


def run_plan(plan: Plan) -> Any:
    """The plan's ``TorchTrainer`` once its nodes are up (:func:`wait_for_workers`), to the end
    (:func:`fit`); a failed run becomes :class:`~raytpu.errors.RunFailed`: ``rank N: <its error>``
    and the failing rank's traceback."""
    from ray.train import TrainingFailedError

    from raytpu.corpus.feeder import stop_feeders

    wait_for_workers(plan)
    if plan.mode == "train":
        from raytpu.records.reports import set_aside_unreadable_ray_state
        from raytpu.storage.run_folder import RunFolder

        warning = set_aside_unreadable_ray_state(RunFolder(plan.run_dir))
        if warning:
            print(f"raytpu: {warning}", file=sys.stderr, flush=True)
    try:
        return fit(build_trainer(plan))
    except TrainingFailedError as exc:
        summary, details = root_cause(exc, plan.run_dir)
        raise RunFailed(summary, details) from exc
    finally:
        stop_feeders()


def root_cause(exc: BaseException, run_dir: str = "") -> tuple[str, str]:
    """``("rank N: last line of the error", the failing rank's traceback)`` of a failed run; a
    controller that could not write the run's records in ``run_dir`` (a full disk) in one line."""
    failures = getattr(exc, "worker_failures", None)
    if failures:
        rank, error = sorted(failures.items())[0]
        cause = error
        while getattr(cause, "cause", None) is not None:
            cause = cause.cause
        fixable = fixable_line(cause)
        if fixable is not None:  # said in one line: no traceback helps with a full disk
            return f"rank {rank}: {fixable}", ""
        return f"rank {rank}: {error_line(cause)}", str(error).strip()
    controller = getattr(exc, "controller_failure", None)
    full = full_disk_in(controller or exc, run_dir) if run_dir else None
    if full is not None:  # Ray Train's controller writing the run's state into its folder
        return f"run failed: {full}", ""
    text = str(controller or exc).strip()
    return f"run failed: {text.splitlines()[-1] if text else type(exc).__name__}", text
