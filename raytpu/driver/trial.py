"""One trial of a ``raytpu tune`` sweep, on the trial's Tune actor: its config (the searched values
and the learning-rate scaling), its plan, and its ``TorchTrainer`` whose reports go on to Tune,
each with a checkpoint that names the raytpu one (what population-based training copies from one
trial to another, and what a resumed sweep restarts a trial from)."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import threading
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError
from ray.train import UserCallback

from raytpu.config import Config, with_values
from raytpu.config.plan import Plan
from raytpu.records import goodput
from raytpu.records.goodput import Command
from raytpu.records.reports import RAY_TRAIN_STATE
from raytpu.records.summary import CHECKPOINT_NAME
from raytpu.storage.filesystems import join
from raytpu.storage.run_folder import RunFolder, copy_folder

#: a trial's Tune checkpoint: which raytpu checkpoint it stands for (Tune copies it; the weights stay put)
POINTER = "raytpu_checkpoint.json"
#: a trial's record of the checkpoints of other trials it went on from (population-based training)
EXPLOITS = "exploits.json"


def trial_config(base: Config, values: dict[str, Any]) -> Config:
    """The config one trial trains with: the base, the searched values, the lr scaling."""
    cfg = with_values(base, values)
    lr = scaled_lr(cfg.optim.lr, cfg.data.global_batch_size, cfg.tune, base.data.global_batch_size)
    return with_values(cfg, {"optim.lr": lr})


def scaled_lr(lr: float, batch: int, tune_cfg: Any, config_batch: int) -> float:
    """``tune.lr_scaling``: the lr is for ``reference_batch_size``; a trial with
    another batch scales it linearly (Goyal et al.) or by the square root."""
    reference = tune_cfg.reference_batch_size or config_batch
    ratio = batch / reference
    if tune_cfg.lr_scaling == "linear":
        return lr * ratio
    if tune_cfg.lr_scaling == "sqrt":
        return lr * math.sqrt(ratio)
    return lr


def run_trial(values: dict[str, Any], sweep_plan: dict[str, Any], runs_dir: str, parent: dict[str, str]) -> None:
    """The Tune trainable: the trial's plan (the sweep's, remade with the trial's values), its
    ``TorchTrainer``, each report passed to Tune with a checkpoint that names the raytpu one; a
    trial Tune started from another trial's checkpoint (population-based training) goes on from a
    copy of it. ``parent``: the sweep's tracker settings (its MLflow run, its W&B group)."""
    from ray import tune

    from raytpu.driver.commands import stage

    command = Command()  # the trial: its goodput counts from its own start
    trial_id = tune.get_context().get_trial_id()
    start = exploited(trial_id, runs_dir, values)
    plan = trial_plan(Plan.from_dict(sweep_plan), {**values, **start}, trial_id, runs_dir, command, parent)
    stage(plan)
    folder = RunFolder(plan.run_dir)
    goodput.begin(folder, command)
    outcome = "failed"
    try:
        fit_reporting_to_tune(plan, trial_id)
        outcome = "completed"
    finally:
        goodput.end(folder, command, outcome)


def exploited(trial_id: str, runs_dir: str, values: dict[str, Any]) -> dict[str, str]:
    """``{"checkpoint.resume_from": ...}`` when Tune starts this trial from another trial's checkpoint
    (PBT's exploit): a copy of it in this trial's folder (the other trial's retention may delete
    its own), recorded in the trial's ``exploits.json``; nothing for a trial's own checkpoint (a
    resumed sweep: the trial resumes from its own newest)."""
    from ray import tune

    found = tune.get_checkpoint()
    if found is None:
        return {}
    with found.as_directory() as directory:
        pointer = json.loads((Path(directory) / POINTER).read_text())
    if pointer["trial"] == trial_id:
        return {}
    folder = RunFolder(join(runs_dir, trial_id))
    exploits = exploits_of(folder)
    source = RunFolder(pointer["checkpoint"].rsplit("/", 1)[0])
    pointer, copy = copy_surviving(pointer, source, folder, len(exploits) + 1)
    for name in [*folder.children(), RAY_TRAIN_STATE]:  # its own line of checkpoints ends here
        if CHECKPOINT_NAME.match(name) or name == RAY_TRAIN_STATE:
            folder.remove(name)
    exploits.append({"from_trial": pointer["trial"], "checkpoint": pointer["checkpoint"], "step": pointer["step"]})
    exploits[-1]["values"] = values
    folder.write_text(EXPLOITS, json.dumps(exploits, indent=2))
    return {"checkpoint.resume_from": copy}


def exploits_of(trial: RunFolder) -> list[dict[str, Any]]:
    """The trial's record of the checkpoints it took from other trials (``exploits.json``), oldest first."""
    return json.loads(trial.read_text(EXPLOITS) or "[]")


def copy_surviving(pointer: dict[str, Any], source: RunFolder, into: RunFolder, number: int) -> tuple[dict, str]:
    """The checkpoint of the trial ``source`` that ``pointer`` names, copied into ``into`` as its
    ``number``-th exploit; where the source's retention has deleted it since Tune chose it (this
    trial's restart came late on a busy machine while the source trained on), its oldest newer
    checkpoint instead: the same trial's state a few steps on. The pointer of what was copied, and
    where the copy is."""
    name = Path(pointer["checkpoint"]).name
    while True:
        copy = f"exploited/{number}-{name}"
        try:
            copy_folder(source.uri(name), into.uri(copy))
            return {**pointer, "checkpoint": source.uri(name), "step": int(name.rsplit("_", 1)[1])}, into.uri(copy)
        except FileNotFoundError:
            into.remove(copy)
            newer = [child for child in source.children() if CHECKPOINT_NAME.match(child) and child > name]
            if not newer:
                raise
            name = newer[0]


class TrialReports(UserCallback):
    """On a trial's Ray Train controller: each report's metrics and its checkpoint's folder name,
    put on the trial's queue, which the trial's Tune session reads."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
        with contextlib.suppress(RayActorError):  # Tune stopped the trial: its queue is gone with it
            self.queue.put((metrics[0], Path(checkpoint.path).name if checkpoint else None))


def fit_reporting_to_tune(plan: Plan, trial_id: str) -> None:
    """The trial's ``TorchTrainer`` on a thread of its own, while this one passes each report to
    Tune with a checkpoint naming the raytpu one (what PBT copies from trial to trial, and what a
    resumed sweep restarts a trial from); the trainer's error, if any, raised here."""
    from ray import tune
    from ray.util.queue import Queue

    from raytpu.driver.ray_trainer import build_trainer

    queue, failed = Queue(actor_options={"num_cpus": 0}), []

    def fit() -> None:
        try:
            build_trainer(plan, callbacks=[TrialReports(queue)]).fit()
        except BaseException as exc:
            failed.append(exc)
        finally:
            with contextlib.suppress(RayActorError):  # Tune stopped the trial: its queue is gone with it
                queue.put(None)

    thread = threading.Thread(target=fit, name="raytpu-trial", daemon=True)
    thread.start()
    while (item := queue.get()) is not None:
        metrics, name = item
        if name is None:
            tune.report(metrics)
            continue
        with tempfile.TemporaryDirectory() as directory:
            pointer = {"trial": trial_id, "checkpoint": join(plan.run_dir, name), "step": metrics.get("step")}
            (Path(directory) / POINTER).write_text(json.dumps(pointer))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    thread.join()
    if failed:
        raise failed[0]


def trial_plan(
    sweep: Plan,
    values: dict[str, Any],
    trial_id: str,
    runs_dir: str,
    command: Command,
    parent: dict[str, str] | None = None,
) -> Plan:
    """A trial's plan: the sweep's, made again by the one plan function from the user's config
    with the trial's values (and its learning-rate scaling), in a folder of its own; its batch is
    checked against the data as the sweep's was."""
    trial = {**values, "optim.lr": trial_config(sweep.asked, values).optim.lr}
    # the sweep records the searched values, early-stopped trials included
    trial.update({"run.name": trial_id, "run.storage_path": runs_dir, "logging.hparams": False, **(parent or {})})
    return sweep.remade(trial, command=command.id, started=command.started)
