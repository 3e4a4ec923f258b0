"""The Python API (``raytpu.train/test/tune/export``): the commands' twins (the command line calls
them: every command test goes through them), returning objects and raising one ``ConfigError`` for a
mistake; a job defined in the caller's own code runs on worker processes, which receive it by value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

import raytpu
from examples.classifier import ClassifierConfig, ClassifierJob


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        ("missing.yaml", (), "config file 'missing.yaml' not found"),
        ({"job": {"name": "mshnet"}, "optim": {"lr_rate": 0.1}}, (), "optim.lr_rate"),
        ({"job": {"name": "mshnet"}}, ({"optim.lr": "fast"},), "optim.lr"),
        ({"job": {"name": "mshnet"}}, (3.5j,), "override"),
        ({"run": {"name": "x"}}, (), "no job given"),
    ],
)
def test_a_mistake_raises_one_config_error_with_the_commands_message(config, overrides, message):
    with pytest.raises(raytpu.ConfigError) as caught:
        raytpu.train(config, *overrides)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_job_object_that_is_not_a_job_is_refused():
    with pytest.raises(raytpu.ConfigError, match="Job subclass"):
        raytpu.train({"run": {"name": "x"}}, job=object())


def moons_job():
    """A job class made inside a function: no module of the workers holds it."""

    @dataclass(frozen=True)
    class MoonsConfig(ClassifierConfig):
        name: str = "moons"
        hidden: int = 16

    class MoonsJob(ClassifierJob):
        name, config_class = "moons", MoonsConfig

    return MoonsJob()


@pytest.mark.integration
def test_a_callers_own_job_trains_on_local_processes_from_a_mapping(tmp_path, capsys):
    """``local=True``: the job, made inside a function, reaches the worker processes by value (a
    Ray worker receives it the same way: ``tests/test_notebook.py``)."""
    config = {
        "run": {"name": "moons", "storage_path": str(tmp_path / "runs")},
        "scaling": {"num_workers": 1},
        "data": {"path": str(tmp_path / "data"), "synthesize_if_missing": True, "global_batch_size": 32},
        "optim": {"name": "adamw", "lr": 0.01},
        "loop": {"epochs": 2},
        "logging": {"progress_bar": False},
    }
    summary = raytpu.train(config, {"job.hidden": 8}, local=True, job=moons_job())
    assert summary.step == 2 * (1024 // 32)
    assert summary.best_checkpoint and Path(summary.best_checkpoint).is_dir()
    assert summary.summary["status"] == "completed"
    assert summary.best_metrics["valid/accuracy"] > 0.8  # chance: 0.5
    printed = capsys.readouterr().out
    assert f"best checkpoint:   {summary.best_checkpoint}" in printed
