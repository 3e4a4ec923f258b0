"""raytpu from Python: :func:`train`, :func:`test`, :func:`tune` and :func:`export`, the twins of
the commands of the same names, for a notebook cell or a script.

Each takes the config as a YAML path, a mapping of sections (as the YAML holds them) or a
:class:`~raytpu.config.Config`, then overrides as the command line takes them (``"optim.lr=0.01"``,
``"--learning_rate", "0.01"``) or as a mapping of dotted keys to values. Each runs the command's
own preparation, checks and console lines, writes the same files, and returns what the command
prints as an object. A mistake raises one :class:`~raytpu.errors.ConfigError` carrying the
command's one-line message; nothing here exits the interpreter.

``job=`` takes a job object instead of a name: a :class:`~raytpu.job.Job` subclass defined in the
caller's module or notebook cell runs on the Ray workers, which receive it by value.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytpu.config import Config
from raytpu.config.loading import read_config
from raytpu.driver.commands import RunSummary
from raytpu.errors import ConfigError, message_of
from raytpu.job import Job, give

#: what the config argument may be: a YAML file, the sections as a mapping, or a built config
ConfigSource = str | Path | Mapping[str, Any] | Config
#: one override: ``"key=value"``, a flag or its value, or a mapping of dotted keys to values
Override = str | Mapping[str, Any]


@dataclass(frozen=True)
class TestResult:
    """What ``raytpu test`` prints: the test metrics of a checkpoint, and where they were written."""

    metrics: dict[str, float]
    checkpoint: str
    run_dir: str


@dataclass(frozen=True)
class SweepResult:
    """What ``raytpu tune`` prints: the sweep's folder, its table as CSV, and the best trial."""

    sweep_dir: str
    results_csv: str
    best_config: str | None = None
    best_trial: str | None = None
    best_metric: float | None = None


def train(
    config: ConfigSource,
    *overrides: Override,
    job: Job | None = None,
    address: str | None = None,
    local: bool = False,
    checkpoint: str | None = None,
    verbose: bool = False,
) -> RunSummary:
    """``raytpu train``: train (or resume the run of the same name) and return its summary: the run
    folder, final and best metrics, latest and best checkpoints, ``summary`` (``summary.json``).
    ``checkpoint``: initial weights. A run stopped by Ctrl-C (a kernel interrupt) or SIGTERM
    checkpoints its step and returns with ``stopped_by`` set; the same call resumes it."""
    from raytpu.driver import commands
    from raytpu.records.goodput import command_started

    started = command_started()
    extra = [f"checkpoint.weights={checkpoint}"] if checkpoint else []
    with user_errors():
        cfg, job, origins = config_of(config, overrides, job, extra + verbosity(verbose))
        with origins.naming_sources():
            summary = commands.train(cfg, job, address, local=local, started=started)
    if summary.stopped_by:
        print(f"raytpu: {commands.stopped_line(summary)}", file=sys.stderr, flush=True)
    return summary


def test(
    config: ConfigSource,
    *overrides: Override,
    job: Job | None = None,
    address: str | None = None,
    checkpoint: str | None = "best",
    verbose: bool = False,
) -> TestResult:
    """``raytpu test``: evaluate ``checkpoint`` (a folder or weights file, or ``best`` / ``latest``
    of the config's run; None: the config's ``checkpoint.weights``) on the test split and return
    its metrics."""
    from raytpu.config import with_values
    from raytpu.driver import commands
    from raytpu.driver.listing import NAMED, resolve_checkpoint

    extra = ["run.mode=test"] + ([f"checkpoint.weights={checkpoint}"] if checkpoint and checkpoint not in NAMED else [])
    with user_errors():
        cfg, job, origins = config_of(config, overrides, job, extra + verbosity(verbose))
        if checkpoint in NAMED:
            cfg = with_values(cfg, {"checkpoint.weights": resolve_checkpoint(cfg, checkpoint)})
        with origins.naming_sources():
            metrics, run_dir = commands.test(cfg, job, address)
    print(json.dumps(metrics), flush=True)
    return TestResult(metrics=metrics, checkpoint=cfg.checkpoint.weights, run_dir=run_dir)


def tune(
    config: ConfigSource,
    *overrides: Override,
    job: Job | None = None,
    address: str | None = None,
    verbose: bool = False,
) -> SweepResult:
    """``raytpu tune``: run (or resume) the sweep and return where its table and best config are.
    The tune flags (``--samples 8``, ``--search optim.lr=loguniform(1e-4,1e-2)``...) are
    overrides like any other."""
    from raytpu.cluster.connect import ray_for_this_command
    from raytpu.driver.search import split_flags
    from raytpu.driver.tune import sweep

    with user_errors():
        rest, tuned, flag_address = split_flags(flat(overrides))
        cfg, job, origins = config_of(config, rest, job, tuned + verbosity(verbose))
        with ray_for_this_command(), origins.naming_sources():
            found = sweep(cfg, job, address or flag_address)
    return SweepResult(**{key: found.get(key) for key in SweepResult.__dataclass_fields__})


def export(
    config: ConfigSource, *overrides: Override, out: str | Path, job: Job | None = None, checkpoint: str = "best"
) -> Path:
    """``raytpu export``: write ``checkpoint`` (``best``, ``latest``, a folder or a weights file) in
    its ecosystem's format (a Transformers folder for the causal LM) to ``out``; returns ``out``."""
    from raytpu.driver.listing import NAMED, resolve_checkpoint
    from raytpu.driver.listing import export as write

    with user_errors():
        cfg, job, origins = config_of(config, overrides, job, [])
        if checkpoint in NAMED:
            checkpoint = resolve_checkpoint(cfg, checkpoint)
        with origins.naming_sources():
            target = write(cfg, job, checkpoint, str(out))
    print(f"exported {job.name} weights from {checkpoint} to {target}", flush=True)
    return target


# ------------------------------------------------------------------ shared
def config_of(
    config: ConfigSource, overrides: tuple[Override, ...] | list[str], job: Job | None, extra: list[str]
) -> tuple[Config, Job, Any]:
    """The config, its job and where its values came from, as the command reads them; a given
    ``job`` is found by its name here and on the workers, and names the config's job."""
    items = flat(overrides)
    if job is not None:
        items.append(f"job.name={give(job).name}")
    return read_config(config, items + extra)


def flat(overrides: tuple[Override, ...] | list[Any]) -> list[str]:
    """Overrides as command-line items: mappings become ``key=value`` (values in YAML's flow style)."""
    items: list[str] = []
    for item in overrides:
        if isinstance(item, Mapping):
            items += [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in item.items()]
        elif isinstance(item, (str, int, float, Path)):
            items.append(str(item))
        else:
            raise ConfigError(f"override {item!r}: give 'key=value' strings, flags, or a mapping of keys to values")
    return items


def verbosity(verbose: bool) -> list[str]:
    return ["logging.verbose=true"] if verbose else []


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user's mistake as one :class:`ConfigError` with the command's message (no chained traceback)."""
    try:
        yield
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        raise ConfigError(message_of(exc)) from None
