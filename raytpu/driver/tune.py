"""``raytpu tune``: a Ray Tune search where every trial is a distributed ``TorchTrainer``.

Ray 2.60 (Train V2) pattern: ``Tuner(driver)`` runs one small driver per
trial; the driver builds the trial's config, applies the learning-rate scaling
and calls ``TorchTrainer.fit()`` with Tune's ``TuneReportCallback``, so the
loop keeps reporting through ``ray.train.report`` exactly as in training.
Tune does not reserve the trials' workers, so the driver asks for almost no
CPU and the number of concurrent trials is derived from what the cluster can fit.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ray.tune import Callback

from raytpu.cluster.capacity import read_offer
from raytpu.cluster.connect import joined_here, one_line
from raytpu.config import Config, ConfigError, TuneSettings, dump_yaml, with_values
from raytpu.config.plan import storage_of, worker_range
from raytpu.driver.ray_trainer import ray_storage, wait_for_workers, worker_bundles
from raytpu.driver.search import (
    REPORT_COUNT,
    Search,
    mutations_of,
    search_algorithm,
    searches_of,
    trial_scheduler,
    within_memory,
)
from raytpu.driver.trial import exploits_of, run_trial, trial_config
from raytpu.job import Job
from raytpu.records import goodput
from raytpu.records import summary as run_summary
from raytpu.records.checkpoints import META
from raytpu.records.trackers import TRACKERS, quick_mlflow_requests
from raytpu.runtime.placement import concurrent_fits
from raytpu.storage.filesystems import join
from raytpu.storage.run_folder import RunFolder

#: what a trial's driver reserves: no CPU (it only waits on its TorchTrainer, whose workers need
#: the CPUs: with any CPU here, 2 workers x 1 CPU never fit a 2-CPU machine) and 1 MiB of memory,
#: because Tune refuses a trial that reserves nothing at all
DRIVER_RESOURCES = {"CPU": 0.0, "memory": float(2**20)}

# ------------------------------------------------------------------ trials
def reports_per_trial(cfg: Config) -> int:
    """ASHA's horizon: the reports (eval rounds) a full trial makes, from the config alone."""
    if cfg.tune.max_t:
        return cfg.tune.max_t
    if not cfg.checkpoint.every_steps and not cfg.loop.max_steps:
        return cfg.loop.epochs
    if cfg.checkpoint.every_steps and cfg.loop.max_steps:
        return math.ceil(cfg.loop.max_steps / cfg.checkpoint.every_steps)
    raise ConfigError("cannot tell how many reports a trial makes; set tune.max_t (reports per full trial)")


def max_concurrent_trials(cfg: Config, nodes: list[dict[str, float]]) -> int:
    """Trials whose workers all fit on the cluster's nodes at once (at least one). Tune does not
    reserve the workers of a trial, so more trials would start drivers whose TorchTrainers wait on
    each other for ever: a larger ``tune.max_concurrent`` is clamped to this, with a warning."""
    fits = concurrent_fits(worker_bundles(cfg), nodes)
    asked = cfg.tune.max_concurrent
    if asked > fits:
        print(
            f"raytpu: warning: --max-concurrent {asked}: only {fits} trial(s) of {cfg.scaling.num_workers} "
            f"worker(s) fit this cluster at once; running {fits} at a time, the rest queue",
            flush=True,
        )
    return min(asked, fits) if asked else fits


# ------------------------------------------------------------------ output
def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Sweep:
    """What one ``raytpu tune`` run knows: the config, the searches, where things go."""

    def __init__(self, cfg: Config, job: Job, searches: list[Search], data_root: str = "") -> None:
        self.cfg, self.job, self.searches = cfg, job, searches
        self.mutations = mutations_of(cfg, searches)  # what PBT perturbs ([] for the other schedulers)
        self.metric = cfg.tune.metric or f"valid/{job.main_metric}"
        self.mode = cfg.tune.mode or job.main_metric_mode
        self.name = cfg.tune.name or f"{cfg.run.name}-tune"
        self.storage = storage_of(cfg)
        self.dir = join(self.storage, self.name)  # a local path or a bucket URI
        self.max_t = reports_per_trial(cfg)
        self.data_root = data_root or cfg.data.path

    @property
    def keys(self) -> list[str]:
        """The keys a trial's values set: the searched ones, then those PBT alone perturbs."""
        searched = [s.key for s in self.searches]
        return searched + [m.key for m in self.mutations if m.key not in searched]

    @property
    def columns(self) -> list[str]:
        scaled = ["lr (scaled)"] if self.cfg.tune.lr_scaling != "none" else []
        exploits = ["exploits"] if self.mutations else []
        return ["trial", *self.keys, *scaled, self.metric, "goodput", "reports", "status", *exploits]

    def exploits(self, trial_id: str) -> str | None:
        """A PBT trial's exploits, in a few words: ``2, last from <trial> at step 8``."""
        found = exploits_of(RunFolder(join(self.dir, "runs", trial_id)))
        if not found:
            return None
        return f"{len(found)}, last from {found[-1]['from_trial']} at step {found[-1]['step']}"

    def row(self, trial_id: str, values: dict[str, Any], metrics: dict[str, Any] | None, status: str) -> dict:
        metrics = metrics or {}
        reports = metrics.get(REPORT_COUNT)
        if status == "TERMINATED":
            status = "done" if reports is not None and reports >= self.max_t else "stopped early"
        row = {"trial": trial_id, **values, self.metric: metrics.get(self.metric), "reports": reports}
        row["goodput"] = f"{metrics['goodput']:.1%}" if isinstance(metrics.get("goodput"), float) else None
        row["status"] = status.lower()
        if self.cfg.tune.lr_scaling != "none":
            row["lr (scaled)"] = trial_config(self.cfg, values).optim.lr
        if self.mutations:
            with contextlib.suppress(OSError):  # a store that stopped answering: the table goes on
                row["exploits"] = self.exploits(trial_id)
        return row


class TableCallback(Callback):
    """Prints the trials' table while the sweep runs: on every trial's end, and on
    results at most every ``every_s`` seconds."""

    def __init__(self, sweep: Sweep, every_s: float = 10.0) -> None:
        self.sweep, self.every_s, self.last = sweep, every_s, 0.0

    def _print(self, trials: list[Any], force: bool = False, ended: Any = None, status: str = "") -> None:
        """``ended``: the trial this callback is told about, whose ``status`` Tune sets only after."""
        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        rows = [
            self.sweep.row(t.trial_id, dict(t.config), t.last_result, status if t is ended else t.status)
            for t in trials
        ]
        print("\n" + format_table(rows, self.sweep.columns), flush=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        self._print(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._print(trials, force=True, ended=trial, status="TERMINATED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._print(trials, force=True, ended=trial, status="ERROR")


class TrialSummaries(Callback):
    """Each trial's ``summary.json`` when Tune has its end (:func:`write_trial_summary`); a trial
    that ended in an earlier run of a resumed sweep keeps its own."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep

    def _write(self, trial: Any, status: str) -> None:
        row = self.sweep.row(trial.trial_id, dict(trial.config), trial.last_result, status)
        with contextlib.suppress(OSError):  # a store that stopped answering: the sweep goes on
            write_trial_summary(self.sweep, row)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._write(trial, "TERMINATED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._write(trial, "ERROR")


# -------------------------------------------------------------------- run
def sweep(cfg: Config, job: Job, address: str | None = None) -> dict[str, Any]:
    """Run (or resume) the sweep; write the table, ``results.csv`` and ``best.yaml``."""
    from ray import tune

    from raytpu.driver.commands import prepare

    if worker_range(cfg):
        raise ConfigError(
            f"raytpu tune runs each trial at one size: scaling.num_workers={cfg.scaling.min_workers}:"
            f"{cfg.scaling.num_workers} is an elastic range, for raytpu train; give one size (scaling.num_workers=N)"
        )
    searches = searches_of(cfg)
    mutations_of(cfg, searches)  # its mistakes, like the searches', are said before Ray starts
    plan = prepare(cfg, "train", job, address, memory=False)
    sweep = Sweep(cfg, job, within_memory(searches, plan, job), plan.facts.data_root)
    concurrent = max_concurrent_trials(plan.config, read_offer(this_machine=joined_here()).capacities())
    runs = join(sweep.dir, "runs")
    parent = sweep_trackers(plan.config, sweep)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, sweep_plan=plan.as_dict(), runs_dir=runs, parent=parent),
        DRIVER_RESOURCES,
    )
    tuner = make_tuner(sweep, trainable, concurrent)
    print(
        f"raytpu: sweep {sweep.name}: {cfg.tune.num_samples} sample(s), up to {concurrent} at once, "
        f"{cfg.tune.scheduler} on {sweep.metric} ({sweep.mode}); directory {sweep.dir}",
        flush=True,
    )
    wait_for_workers(plan)  # the first trial's nodes; later trials find them up, or wait in Ray Train
    status = "FAILED"
    before = live_placement_groups()
    try:
        summary = finish(sweep, tuner.fit())
        status = "FINISHED"
        return summary
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        release_placement_groups(live_placement_groups() - before)
        end_sweep_trackers(plan.config, parent, status)


def live_placement_groups() -> set[str]:
    """The placement groups of this driver's job (a group's id ends with its job's) not yet removed."""
    import ray
    from ray.util import placement_group_table

    job = ray.get_runtime_context().get_job_id()
    table = placement_group_table().items()
    return {pg_id for pg_id, entry in table if pg_id.endswith(job) and entry.get("state") != "REMOVED"}


def release_placement_groups(pg_ids: set[str]) -> None:
    """Remove the placement groups the sweep's trials left behind: a trial that a scheduler stops
    leaves its worker group's reservation in place until the driver exits, and a notebook's kept
    Ray instance would hold those CPUs from the next call."""
    import ray
    from ray.util import remove_placement_group
    from ray.util.placement_group import PlacementGroup

    for pg_id in pg_ids:
        with contextlib.suppress(Exception):  # removed meanwhile by Ray Train's own cleaner
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


def sweep_trackers(cfg: Config, sweep: Sweep) -> dict[str, str]:
    """What each trial's trackers hang under: an MLflow run of the sweep, the parent of each trial's
    run (the same one when the sweep resumes: its id is kept in the sweep's folder), and a W&B
    group named after the sweep."""
    parent: dict[str, str] = {}
    if "wandb" in cfg.logging.report_to:
        parent["logging.wandb_group"] = sweep.name
    if "mlflow" in cfg.logging.report_to:
        from mlflow.tracking import MlflowClient

        quick_mlflow_requests()
        folder, log = RunFolder(sweep.dir), cfg.logging
        saved = json.loads(folder.read_text(TRACKERS) or "{}").get("mlflow", {}).get("run_id", "")
        client = MlflowClient(log.mlflow_tracking_uri)
        if saved:
            client.update_run(saved, status="RUNNING")
        else:
            found = client.get_experiment_by_name(log.experiment)
            experiment = found.experiment_id if found else client.create_experiment(log.experiment)
            saved = client.create_run(experiment, run_name=sweep.name, tags={"raytpu.sweep": sweep.name}).info.run_id
            folder.write_text(TRACKERS, json.dumps({"mlflow": {"run_id": saved}}, indent=2))
        parent["logging.mlflow_parent_run"] = saved
    return parent


def end_sweep_trackers(cfg: Config, parent: dict[str, str], status: str = "FINISHED", timeout_s: float = 30.0) -> None:
    """The sweep's MLflow run ended with the sweep's ``status`` (FINISHED, FAILED, KILLED), within
    ``timeout_s``: a tracking server that stopped answering is a warning, and never hides the
    sweep's own error or keeps it waiting."""
    run_id = parent.get("logging.mlflow_parent_run")
    if not run_id:
        return
    from mlflow.tracking import MlflowClient

    failure: list[BaseException] = []

    def terminate() -> None:
        try:
            MlflowClient(cfg.logging.mlflow_tracking_uri).set_terminated(run_id, status=status)
        except Exception as exc:
            failure.append(exc)

    quick_mlflow_requests()
    thread = threading.Thread(target=terminate, name="raytpu-mlflow-sweep", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or failure:
        reason = one_line(failure[0]) if failure else f"no answer within {timeout_s:g} s"
        print(
            f"raytpu: warning: MLflow did not take the sweep's end ({reason}); its run stays RUNNING there",
            file=sys.stderr,
            flush=True,
        )


def make_tuner(sweep: Sweep, trainable: Any, concurrent: int) -> Any:
    from ray import tune

    storage = ray_storage(sweep.storage)
    fs, path = storage.get("storage_filesystem"), join(storage["storage_path"], sweep.name)
    if tune.Tuner.can_restore(path, storage_filesystem=fs):
        print(f"raytpu: resuming sweep {sweep.dir} (finished trials are kept)", flush=True)
        return tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=True, storage_filesystem=fs)
    tc = sweep.cfg.tune
    return tune.Tuner(
        trainable,
        param_space={s.key: s.domain() for s in sweep.searches},
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode=sweep.mode,
            num_samples=tc.num_samples,
            search_alg=search_algorithm(sweep),
            scheduler=trial_scheduler(sweep),
            max_concurrent_trials=concurrent,
            trial_dirname_creator=trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=sweep.name,
            **storage,
            callbacks=[TrialSummaries(sweep), TableCallback(sweep)],  # a trial shown done has its summary
            verbose=0,
        ),
    )


def finish(sweep: Sweep, results: Any) -> dict[str, Any]:
    rows = []
    for result in results:
        status = "ERROR" if result.error else "TERMINATED"
        trial_id = trial_id_of(result)
        rows.append(sweep.row(trial_id, values_of(sweep, trial_id, result), result.metrics, status))
    print("\n" + format_table(rows, sweep.columns), flush=True)
    folder = RunFolder(sweep.dir)
    folder.write_text("results.csv", csv_text(rows, sweep.columns))
    csv_path = folder.uri("results.csv")
    summary: dict[str, Any] = {"sweep_dir": sweep.dir, "results_csv": csv_path, "best_config": None}
    scored = [r for r in rows if r[sweep.metric] is not None]
    write_hparams(sweep, rows)
    if scored:
        best = (max if sweep.mode == "max" else min)(scored, key=lambda r: r[sweep.metric])
        values = {key: best[key] for key in sweep.keys}
        best_path = write_best_config(sweep, values, best["trial"])
        summary.update(best_config=str(best_path), best_trial=best["trial"], best_metric=best[sweep.metric])
        print(f"best trial:   {best['trial']} {sweep.metric}={best[sweep.metric]:.4g} {values}")
        print(f"best config:  {best_path}  (raytpu train {best_path})")
    print(f"results:      {csv_path}")
    print(f"tensorboard:  tensorboard --logdir {folder.uri('runs')}  (HPARAMS tab compares the trials)", flush=True)
    return summary


#: a Tune trial's id (``50abb_00001``)
TRIAL_ID = re.compile(r"[0-9a-f]+_\d+")
#: a trial's status in the sweep's table -> its run's outcome in summary.json
TRIAL_OUTCOMES = {"done": "completed", "stopped early": "stopped"}


def write_trial_summary(sweep: Sweep, row: dict[str, Any]) -> None:
    """A trial's ``summary.json``, as a ``raytpu train`` run writes its own, from its checkpoints'
    ``meta.json`` (the best by the job's main metric on the validation split): written by the
    sweep's driver at the trial's end (:class:`TrialSummaries`), since Tune ends the trial's actor as
    soon as it has the last result."""
    from raytpu.driver.commands import summary_of

    folder = RunFolder(join(sweep.dir, "runs", row["trial"]))
    main, mode = f"valid/{sweep.job.main_metric}", sweep.job.main_metric_mode
    worst = -math.inf if mode == "max" else math.inf
    reported = [
        (folder.uri(meta["name"]), {**meta["metrics"], "step": meta["step"], "score": meta["metrics"].get(main, worst)})
        for meta in run_summary.checkpoints(folder)
    ]
    ended = summary_of(folder.location, reported, mode).record()
    outcome = TRIAL_OUTCOMES.get(row["status"], "failed")
    record = goodput.read_record(folder)
    run_summary.write(folder, outcome, ended, {**record, **goodput.breakdown(record)})


def trial_dirname(trial: Any) -> str:
    """A trial's folder of Tune's records: its id, which names its raytpu run folder too."""
    return trial.trial_id


def trial_id_of(result: Any) -> str:
    """The trial whose result this is: its folder's name (:func:`trial_dirname`). Its last result's
    ``trial_id`` is another trial's when it ended after an exploit and before a report of its own
    (Tune restores a trial's last result with the checkpoint it takes); that of a sweep begun
    before its folders were named by id."""
    name = Path(result.path).name
    return name if TRIAL_ID.fullmatch(name) else str((result.metrics or {}).get("trial_id") or name)


def values_of(sweep: Sweep, trial_id: str, result: Any) -> dict[str, Any]:
    """The searched values a trial last trained with: those of its last exploit (PBT's), when it had
    one, since its last result may be the one it took with the other trial's checkpoint."""
    taken = exploits_of(RunFolder(join(sweep.dir, "runs", trial_id)))
    return {**(result.config or {}), **(taken[-1]["values"] if taken else {})}


def csv_text(rows: list[dict[str, Any]], columns: list[str]) -> str:
    handle = io.StringIO(newline="")
    writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return handle.getvalue()


def write_best_config(sweep: Sweep, values: dict[str, Any], trial_id: str) -> str:
    """A YAML that ``raytpu train`` runs as the best trial ran (same values, seed and scaled lr); a
    PBT trial's with the base lr it went on with at each step (``optim.lr_changes``), its own and
    the trials' whose checkpoints it took, and the final values of the other keys PBT perturbed."""
    cfg = with_values(trial_config(sweep.cfg, values), {"run.name": f"{sweep.name}-best", "data.path": sweep.data_root})
    cfg = dataclasses.replace(cfg, tune=TuneSettings())  # runtime and the rest as asked: best.yaml stays portable
    header = f"# best trial of sweep {sweep.name} on {sweep.metric} ({sweep.mode}): {values}\n"
    if sweep.mutations:
        cfg = with_values(cfg, lr_schedule(RunFolder(join(sweep.dir, "runs", trial_id))))
        header += "# trained by population-based training: the lr it went on with is optim.lr_changes\n"
    folder = RunFolder(sweep.dir)
    folder.write_text("best.yaml", header + dump_yaml(cfg))
    return folder.uri("best.yaml")


def taken_last(trial: RunFolder) -> dict[str, Any] | None:
    """What the checkpoint a trial took last says (its ``meta.json``): the trial's final state when
    the exploit came at its last report, so that it wrote no checkpoint of its own after it."""
    exploits = exploits_of(trial)
    if not exploits:
        return None
    text = trial.read_text(f"exploited/{len(exploits)}-{Path(exploits[-1]['checkpoint']).name}/{META}")
    return json.loads(text) if text else None


def lr_schedule(trial: RunFolder) -> dict[str, Any]:
    """``optim.lr`` and ``optim.lr_changes`` from the base lrs the trial's newest checkpoint went on
    with, step by step (``lr_steps`` in its ``meta.json``, carried over from the checkpoints it took)."""
    found = run_summary.checkpoints(trial)
    newest = found[-1] if found else taken_last(trial)
    steps = newest.get("lr_steps", []) if newest else []
    if not steps:
        return {}
    changes = {int(step): float(lr) for step, lr in steps[1:]}
    return {"optim.lr": float(steps[0][1]), "optim.lr_changes": changes}


def write_hparams(sweep: Sweep, rows: list[dict[str, Any]]) -> None:
    """Each trial's searched values into its own TensorBoard run, so that the HPARAMS
    tab lines the trials up against the metric the run already logs as a scalar."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    for row in rows:
        trial = RunFolder(join(sweep.dir, "runs", row["trial"]))
        if not trial.exists("tensorboard") or row[sweep.metric] is None:
            continue
        values = {key: row[key] for key in sweep.keys}
        with SummaryWriter(log_dir=str(trial.local("tensorboard"))) as writer:
            for summary in hparams(values, {sweep.metric: row[sweep.metric]}):
                writer.file_writer.add_summary(summary)
        trial.sync("tensorboard")
