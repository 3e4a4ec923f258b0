"""``raytpu runs PATH``: a run's checkpoints, or the runs under a storage path, at a glance;
``--checkpoint best|latest`` of ``raytpu test`` / ``raytpu export`` resolved to a run's checkpoint;
and ``raytpu export``: a checkpoint's weights in the format the job's ecosystem loads (on the CPU).

Both read the run folders as the driver left them (``summary.json``, each checkpoint's
``meta.json``; :mod:`raytpu.records.summary`), on a disk or in a bucket.
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from raytpu.config import Config, ConfigError
from raytpu.config.plan import storage_of
from raytpu.job import Exports, Job
from raytpu.records import checkpoints as ckpt
from raytpu.records import resizes
from raytpu.records import summary as run_summary
from raytpu.storage.filesystems import join
from raytpu.storage.run_folder import RunFolder

#: the ``--checkpoint`` words that name a checkpoint of the config's own run
NAMED = ("best", "latest")


def describe(location: str) -> str:
    """The table of the run at ``location``, or of the runs under it; a ConfigError when it holds neither."""
    folder = RunFolder(location)
    if folder.exists("config.yaml"):
        return run_table(folder)
    runs = [name for name in folder.children() if RunFolder(join(location, name)).exists("config.yaml")]
    if not runs:
        raise ConfigError(
            f"{location} holds no run (no config.yaml) and no runs: give a run folder "
            "(run.storage_path/run.name) or a run.storage_path"
        )
    return runs_table(location, runs)


def run_table(folder: RunFolder) -> str:
    summary = run_summary.read(folder) or {}
    marks = {summary.get("best_checkpoint"): "best", summary.get("latest_checkpoint"): "latest"}
    if summary.get("best_checkpoint") == summary.get("latest_checkpoint"):
        marks[summary.get("best_checkpoint")] = "best, latest"
    lines = [
        f"run {folder.location}: {status_of(summary)}",
        "checkpoint          step  epoch  workers  reason     metrics",
    ]
    for found in run_summary.checkpoints(folder):
        mark = f"  <- {marks[found['name']]}" if found["name"] in marks else ""
        lines.append(
            f"{found['name']}  {found.get('step', '?'):>5}  {found.get('epoch', '?'):>5}  "
            f"{found.get('world_size', '?'):>7}  {found.get('reason', ''):<9}  "
            f"{metrics_text(found.get('metrics', {}))}{mark}"
        )
    if len(lines) == 2:
        lines.append("(no complete checkpoint yet)")
    for change in resizes.read(folder):
        when = datetime.datetime.fromtimestamp(change["ended"]).isoformat(timespec="seconds")
        lines.append(f"workers {change['from']} -> {change['to']} at {when}: {change['reason']}")
    return "\n".join(lines)


def runs_table(location: str, runs: list[str]) -> str:
    lines = [f"runs under {location}:", "run                       status      step  best checkpoint     best metrics"]
    for name in runs:
        summary = run_summary.read(RunFolder(join(location, name))) or {}
        lines.append(
            f"{name:<24}  {summary.get('status', 'no summary'):<10}  {summary.get('step') or '':>4}  "
            f"{summary.get('best_checkpoint') or '':<18}  {metrics_text(summary.get('best_metrics', {}))}"
        )
    return "\n".join(lines)


def status_of(summary: dict[str, Any]) -> str:
    """How the run's last command ended, and when; or that none has (it runs, or it died unrecorded)."""
    if not summary:
        return "no summary.json yet (the run is going, or its driver died before writing it)"
    attempts = summary.get("attempts", [])
    ended = attempts[-1].get("ended") if attempts else None
    when = f" at {datetime.datetime.fromtimestamp(ended).isoformat(timespec='seconds')}" if ended else ""
    fraction = (summary.get("goodput") or {}).get("goodput")
    goodput = f", goodput {fraction:.1%}" if isinstance(fraction, float) else ""
    return f"{summary.get('status')}{when} after {len(attempts)} command(s), step {summary.get('step')}{goodput}"


def metrics_text(metrics: dict[str, Any]) -> str:
    return " ".join(f"{key}={value:.4g}" for key, value in sorted(metrics.items()) if isinstance(value, (int, float)))


def resolve_checkpoint(cfg: Config, which: str) -> str:
    """``best`` or ``latest``: that checkpoint of the config's run (``run.storage_path/run.name``)."""
    run_dir = join(storage_of(cfg), cfg.run.name)
    name = run_summary.named_checkpoint(RunFolder(run_dir), which)
    if name is None:
        why = "no summary.json (no command of it has ended)" if which == "best" else "no complete checkpoint"
        raise ConfigError(
            f"--checkpoint {which}: the run {run_dir} has {why}; check run.storage_path and run.name "
            "(raytpu runs RUN_DIR lists a run's checkpoints), or give a checkpoint folder"
        )
    return join(run_dir, name)


# ------------------------------------------------------------------ raytpu export
def export(cfg: Config, job: Job, checkpoint: str, out: str) -> Path:
    """Build the job's model, load ``checkpoint`` (its EMA weights when it has them) and let the job
    write it to ``out``; the data root holds what travels with the model (a tokenizer)."""
    from raytpu.driver.preflight import resolve_data_root

    if not isinstance(job, Exports):
        raise ConfigError(f"job {job.name!r} has no export format: its checkpoints' model.safetensors are the weights")
    if not checkpoint:
        raise ConfigError("export needs --checkpoint PATH (a checkpoint folder or weights file)")
    if not out:
        raise ConfigError(f"export needs --out DIR, e.g. --out exports/{job.name}")
    ckpt.check_weights(checkpoint)
    data_root = resolve_data_root(cfg, job, synthesize=False)
    model = job.build_model(cfg)
    weights = ckpt.with_ties(ckpt.load_model_weights(checkpoint), model)
    expected = {k: v for k, v in model.state_dict().items() if k in weights or k not in ckpt.frozen_names(model)}
    mismatch = weights_mismatch(expected, weights)
    if mismatch:
        hint = run_config(checkpoint)
        raise ConfigError(f"{checkpoint} does not hold weights of this config's model: {mismatch}{hint}")
    ckpt.load_into(model, weights)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    job.export(model.eval(), cfg, data_root, target)
    return target


def run_config(checkpoint: str) -> str:
    """Where the config the checkpoint's run trained with is (its run folder's ``config.yaml``), to
    export with: its model settings (LoRA adapters, a model of another shape) are the weights'."""
    written = Path(checkpoint)
    folder = written.parent if written.is_dir() else written.parent.parent
    trained = folder / "config.yaml"
    if not trained.is_file():
        return ""
    return f"; export with the config its run trained with: raytpu export {trained} --checkpoint {checkpoint}"


def weights_mismatch(expected: dict[str, Any], found: dict[str, Any]) -> str:
    """What differs between a model's state_dict and a checkpoint's weights, in a few words ("" = nothing)."""
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    reshaped = [key for key in expected if key in found and tuple(found[key].shape) != tuple(expected[key].shape)]
    parts = [f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []
    parts += [f"{len(unexpected)} unexpected (e.g. {unexpected[0]})"] if unexpected else []
    if reshaped:
        key = reshaped[0]
        shapes = f"{tuple(found[key].shape)} for {tuple(expected[key].shape)}"
        parts.append(f"{len(reshaped)} of another shape (e.g. {key}: {shapes})")
    return "; ".join(parts)
