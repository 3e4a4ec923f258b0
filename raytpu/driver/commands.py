"""``raytpu train`` and ``raytpu test`` on the driver: check, resolve the plan, start the workers,
say where everything is.

One preparation for every command (:func:`prepare`: train, test, a Tune sweep, ``raytpu
launch``): the checks that need no cluster (storage, weights, trackers, data), the cluster joined
(or, with ``--local``, this machine looked at) and what it offers read, then the one plan function
(``raytpu.config.plan.make_plan``), the workers checked against the cluster, a resume against the
run's checkpoints, the memory estimate. The plan then runs on Ray Train's workers
(``raytpu.driver.ray_trainer``) or on local processes (``raytpu.driver.local``), and both end in
one :class:`RunSummary`. Nothing here touches an accelerator.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytpu.cluster.capacity import read_offer
from raytpu.cluster.connect import (
    STARTED_HERE,
    connect,
    joined,
    joined_here,
    leave,
    ray_for_this_command,
    starts_local_instance,
)
from raytpu.config import Config, dump_yaml
from raytpu.config.memory import check_memory
from raytpu.config.plan import Facts, Plan, ScriptPlan, make_plan
from raytpu.corpus.prepare import corpus_words, is_text_run, streamed, text_sizes
from raytpu.driver import preflight
from raytpu.driver.signals import StopOnSignal
from raytpu.errors import RunFailed
from raytpu.job import Job
from raytpu.records import devices, goodput, resizes
from raytpu.records import summary as run_summary
from raytpu.records.batches import recorded_text
from raytpu.records.goodput import Command
from raytpu.records.progress import DriverBar, board_name, in_notebook
from raytpu.records.relay import checkpoint_names, last_state_number
from raytpu.records.reports import best_of, complete, entry_of, read_report
from raytpu.runtime.placement import ClusterOffer
from raytpu.storage.filesystems import is_remote, join
from raytpu.storage.run_folder import RunFolder

os.environ.setdefault("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "0")


# ------------------------------------------------------------------ the summary
@dataclass(frozen=True)
class RunSummary:
    """How a run ended, whatever ran it: its folder, checkpoints and last metrics."""

    run_dir: str
    latest_checkpoint: str | None
    best_checkpoint: str | None
    metrics: dict[str, float]
    step: int | None
    stopped_by: int | None = None
    best_metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        """The run's ``summary.json``: its status, these checkpoints and metrics, its goodput."""
        return run_summary.read(RunFolder(self.run_dir)) or {}

    def record(self) -> dict[str, Any]:
        """What ``summary.json`` keeps of it (``raytpu.records.summary``)."""
        return {
            "step": self.step,
            "latest_checkpoint": self.latest_checkpoint,
            "best_checkpoint": self.best_checkpoint,
            "metrics": self.metrics,
            "best_metrics": self.best_metrics,
        }

    @property
    def tensorboard(self) -> str:
        return join(self.run_dir, "tensorboard")

    def lines(self, found_batch: str | None = None) -> list[str]:
        """``found_batch``: the batch ``loop.auto_find_batch_size`` stepped down to, if it did."""
        lines = [f"run directory:     {self.run_dir}", f"config:            {join(self.run_dir, 'config.yaml')}"]
        if found_batch:
            lines.append(f"batch size:        {found_batch}, found by auto_find_batch_size")
        return lines + [
            f"tensorboard:       tensorboard --logdir {self.tensorboard}",
            f"latest checkpoint: {self.latest_checkpoint}",
            f"best checkpoint:   {self.best_checkpoint}",
            "final metrics:     " + json.dumps(self.metrics),
        ]


def summary_of(run_dir: str, reported: list[tuple[str, dict[str, Any]]], mode: str) -> RunSummary:
    """The summary of a run from its reported checkpoints (path, metrics), oldest first: the best
    by the one rule of ``raytpu.worker.reporting``, the metrics of the latest."""
    entries = [entry_of(path, metrics, order) for order, (path, metrics) in enumerate(reported)]
    best = best_of(entries, mode)
    latest, metrics = reported[-1] if reported else (None, {})
    best_metrics = dict(reported)[best.name] if best else {}
    return RunSummary(
        run_dir=run_dir,
        latest_checkpoint=latest,
        best_checkpoint=best.name if best else None,
        metrics=scalars_of(metrics),
        step=metrics.get("step"),
        best_metrics=scalars_of(best_metrics),
    )


def scalars_of(metrics: dict[str, Any]) -> dict[str, float]:
    """The ``split/name`` metrics of a report (not its bookkeeping: step, score, report count)."""
    return {k: v for k, v in metrics.items() if "/" in k}


# ------------------------------------------------------------------ the plan
def prepare(
    cfg: Config,
    mode: str,
    job: Job | None = None,
    address: str | None = None,
    local: bool = False,
    command: Command | None = None,
    stop: str = "",
    script: ScriptPlan | None = None,
    marks: dict[str, float] | None = None,
    memory: bool = True,
) -> Plan:
    """Every command's one preparation: every check it needs, what the cluster offers, the plan
    (:func:`~raytpu.config.plan.make_plan`), the workers against the cluster, a resume against the
    run's checkpoints, the memory estimate, and the lines that say it. ``mode``: train, test or
    launch (a Tune sweep prepares its train run once); ``job`` None: a launched ``script``, whose
    data and model are its own. ``marks`` gets when the driver began and ended joining Ray;
    ``memory`` False: the caller checks the memory itself (a sweep, value by value)."""
    data_root, sizes = preflight.check_run(cfg, job, mode, address, local)
    marks = {} if marks is None else marks
    if script is not None:  # the launch-state numbers of a rerun come after the run folder's own
        names = checkpoint_names(RunFolder(join(cfg.run.storage_path, cfg.run.name)))
        script = dataclasses.replace(script, last_checkpoint=last_state_number(names))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    command = command or Command()
    facts = Facts(
        mode=mode,
        local=local,
        main_metric_mode=job.main_metric_mode if job else "min",
        data_root=str(data_root or ""),
        data_words=corpus_words(cfg, job, data_root) if job is not None and is_text_run(cfg, job) else "",
        split_sizes=tuple(sizes.items()),
        text=job is not None and streamed(cfg, job),
        name="" if mode != "test" else f"{cfg.run.name}/test-{stamp}",
        command=command.id,
        started=command.started,
        stop=stop,
        script=script,
    )
    marks["connect"] = time.time()
    if local:
        facts = dataclasses.replace(facts, offer=local_offer(), where="local processes")
    else:
        if starts_local_instance(address):  # it would hold this machine: a run it cannot place is refused first
            preflight.check_placement(make_plan(cfg, dataclasses.replace(facts, offer=local_offer())))
        connect(address, quiet=mode == "test", verbose=cfg.logging.verbose)
        board = board_name(command.id) if mode == "train" and in_notebook() else ""
        facts = dataclasses.replace(
            facts, offer=read_offer(this_machine=joined_here()), where=joined(), progress_board=board
        )
    marks["connected"] = time.time()
    if facts.text:  # counted by Ray Data tasks
        facts = dataclasses.replace(facts, split_sizes=tuple(text_sizes(cfg, job, data_root, mode).items()))
    plan = make_plan(cfg, facts)
    preflight.check_plan(plan, job)
    estimate = check_memory(plan.config, job, facts.offer.accelerator_types("GPU")) if job and memory else []
    say(plan, estimate)
    return plan


def say(plan: Plan, more: list[str] | tuple[str, ...] = ()) -> None:
    """The plan's notes and ``more`` (the memory estimate), then its one line: where, what, how the
    batch splits (a launch's: the script and its processes)."""
    for note in [*plan.notes, *more]:
        print(f"raytpu: {note}", file=sys.stderr if note.startswith("warning:") else sys.stdout, flush=True)
    print(where_it_runs(plan), flush=True)


def where_it_runs(plan: Plan) -> str:
    """One line: the cluster, the workers, the runtime and precision, and the batch per worker."""
    cfg, batch, script = plan.config, plan.batch, plan.script
    if batch is None:
        assert script is not None
        precision = script.mixed_precision or "as the script sets it"
        return (
            f"raytpu: launch {Path(script.path).name} as run {cfg.run.name} on {plan.facts.where}: "
            f"{cfg.scaling.num_workers} {cfg.scaling.runtime} process(es), mixed precision {precision}"
        )
    accum = f" x {batch.grad_accum} accumulation steps" if batch.grad_accum > 1 else ""
    compiled = f", torch.compile ({cfg.loop.compile_mode})" if cfg.loop.compile == "true" else ""
    if batch.workers != cfg.scaling.num_workers:  # tensor groups: their workers read the same samples
        compiled += f", tensor groups of {cfg.scaling.num_workers // batch.workers}"
    return (
        f"raytpu: {plan.mode} {cfg.run.name} on {plan.facts.where}: {cfg.scaling.num_workers} {cfg.scaling.runtime} "
        f"worker(s), {cfg.scaling.precision}{compiled}, {batch.per_worker} samples per worker{accum} "
        f"(global batch {batch.global_batch})"
    )


def local_offer() -> ClusterOffer:
    """This machine as ``--local`` sees it: its CPUs, GPUs and TPU device files (never torch_xla)."""
    import torch

    from raytpu.runtime.tpu import tpu_present

    node = {"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count()), "TPU": float(tpu_present())}
    return ClusterOffer(nodes=(node,), available=node, this_machine=True)


def stage(plan: Plan) -> None:
    """The run's folder, with the config it runs with (a training run's ``config.yaml``)."""
    RunFolder(plan.run_dir).write_text("config.yaml", dump_yaml(plan.config))


# ------------------------------------------------------------------ the commands
def train(
    cfg: Config, job: Job, address: str | None = None, local: bool = False, started: float | None = None
) -> RunSummary:
    """Train through Ray (or, with ``local``, in local processes) and print where everything is,
    with the run's goodput. ``started``: when the command started (default: now). A run stopped by
    a signal returns too, its ``stopped_by`` set (:func:`stopped_line` says it)."""
    command = Command(started=started or time.time())
    instances = tuple(STARTED_HERE)  # Ray instances of this process that the command did not start
    stop = StopOnSignal(local=local)
    try:
        plan = prepare(cfg, "train", job, address, local, command, stop.spec)
    except BaseException:
        leave(keep=instances)
        raise
    stage(plan)
    folder = RunFolder(plan.run_dir)
    goodput.begin(folder, command)
    try:
        with stop:
            summary = train_locally(plan, stop) if local else train_on_ray(plan)
            summary = dataclasses.replace(summary, stopped_by=stop.stopped_by())
    except BaseException:
        leave(keep=instances)
        with contextlib.suppress(OSError):  # a store that stopped answering keeps the record it has
            run_summary.write(folder, "failed", {}, goodput.end(folder, command, "failed"))
        raise
    leave(keep=instances)
    outcome = "stopped" if summary.stopped_by else "completed"
    record = goodput.end(folder, command, outcome)
    run_summary.write(folder, outcome, summary.record(), record)
    write_goodput_scalars(folder, record, summary.step or 0)
    found = recorded_text(folder, plan.batch.global_batch)
    ran = devices.read(folder)
    lines = [*summary.lines(found), *([f"ran as:            {devices.line(ran)}"] if ran else [])]
    print("\n".join([*lines, *goodput_lines(folder, record, command)]), flush=True)
    return summary


def goodput_lines(folder: RunFolder, record: dict[str, Any], command: Command) -> list[str]:
    """The goodput of the run (of a run resumed by this command, this command's, then the run's),
    and where this command's start-up went."""
    count = len(record["commands"])
    parts = goodput.startup_parts(goodput.find_command(record, command))
    startup = [f"start-up:          {', '.join(f'{part} {s:.1f} s' for part, s in parts.items())}"] if parts else []
    if count == 1:
        return [f"goodput:           {goodput.summary_line(record)}", *startup]
    changes = [change["ended"] for change in resizes.read(folder)]
    return [
        f"goodput:           {goodput.command_summary(record, command, changes)}, this command",
        f"                   {goodput.summary_line(record)}, the run's {count} commands",
        *startup,
    ]


def stopped_line(summary: RunSummary) -> str:
    """What a run stopped by a signal (``summary.stopped_by``) tells its user."""
    assert summary.stopped_by
    return (
        f"stopped by {signal.Signals(summary.stopped_by).name} after checkpointing step {summary.step}; "
        "run the same command again to resume from there"
    )


def write_goodput_scalars(folder: RunFolder, record: dict[str, Any], step: int) -> None:
    """The breakdown in TensorBoard (``goodput/fraction``, ``goodput/<category>_s``), at the last step."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(log_dir=str(folder.local("tensorboard"))) as writer:
        writer.add_scalar("goodput/fraction", record["goodput"], step)
        for name, seconds in record["categories"].items():
            writer.add_scalar(f"goodput/{name}_s", seconds, step)
    folder.sync("tensorboard")


def train_on_ray(plan: Plan) -> RunSummary:
    from raytpu.driver.ray_trainer import run_plan

    try:
        with DriverBar(plan.facts.progress_board):
            result = run_plan(plan)
    except RunFailed:
        if is_remote(plan.storage):
            preflight.check_still_answering(plan.storage)
        raise
    reported = sorted(
        ((located(plan, checkpoint), metrics) for checkpoint, metrics in result.best_checkpoints),
        key=lambda pair: pair[1].get("report", 0),
    )
    latest = located(plan, result.checkpoint) if result.checkpoint else None
    if latest is not None and all(path != latest for path, _ in reported):
        reported.append((latest, result.metrics or {}))
    summary = summary_of(plan.run_dir, reported, plan.facts.main_metric_mode)
    return dataclasses.replace(summary, latest_checkpoint=latest, step=(result.metrics or {}).get("step"))


def located(plan: Plan, checkpoint: Any) -> str:
    """A checkpoint of the run as its user names it: a local path, or a URI in the run's bucket."""
    return join(plan.run_dir, Path(checkpoint.path).name)


def train_locally(plan: Plan, stop: StopOnSignal) -> RunSummary:
    from raytpu.driver.local import run_processes

    run_processes(plan, stop)
    reported = [(str(path), read_report(path)) for path in complete(Path(plan.run_dir))]
    return summary_of(plan.run_dir, reported, plan.facts.main_metric_mode)


def test(cfg: Config, job: Job, address: str | None = None) -> tuple[dict[str, float], str]:
    """Evaluate ``checkpoint.weights``; returns the test metrics and the folder they are in."""
    from raytpu.driver.ray_trainer import run_plan

    with ray_for_this_command():
        plan = prepare(cfg, "test", job, address)
        result = run_plan(plan)
    folder = located(plan, result.checkpoint)
    return json.loads(RunFolder(folder).read_text("test_metrics.json") or "{}"), folder
