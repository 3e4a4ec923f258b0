"""``raytpu tune``: search-string parsing and the sweep's pure parts without Ray;
an ASHA sweep on MSHNet small, its best config and an interrupted-then-resumed
sweep on the session's local Ray instance."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytpu.config import ConfigError, load_config, with_values
from raytpu.driver.search import Search, parse_search, searches_of
from raytpu.driver.tune import (
    format_table,
    max_concurrent_trials,
    reports_per_trial,
    scaled_lr,
    split_flags,
    trial_config,
)

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "jobs/mshnet/small.yaml")
TINY = [
    "loop.epochs=3",
    "job.warm_epoch=-1",
    "job.base_size=32",
    "job.crop_size=32",
    "scaling.num_workers=1",
    "scaling.cpus_per_worker=0.5",
    "data.global_batch_size=4",
    "logging.progress_bar=false",
    "logging.eval_images=0",
]


# ------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "text, expected",
    [
        ("optim.lr=loguniform(1e-4,1e-1)", Search("optim.lr", "loguniform", (1e-4, 0.1))),
        ("optim.lr = uniform(0.001, 0.01)", Search("optim.lr", "uniform", (0.001, 0.01))),
        ("data.global_batch_size=choice(8,16,32)", Search("data.global_batch_size", "choice", (8, 16, 32))),
        ("loop.epochs=randint(1, 4)", Search("loop.epochs", "randint", (1, 4))),
        ("optim.name=grid(adam, sgd)", Search("optim.name", "grid", ("adam", "sgd"))),
    ],
)
def test_parse_search(text, expected):
    assert parse_search(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("optim.lr", "is not key=domain(args)"),
        ("optim.lr=0.1", "is not key=domain(args)"),
        ("optim.lr=normal(0, 1)", "unknown domain 'normal'"),
        ("optim.lr=uniform(1)", "takes two numbers"),
        ("optim.lr=uniform(0.1, 0.01)", "lower bound must be below"),
        ("optim.lr=loguniform(0, 1)", "positive lower bound"),
        ("loop.epochs=randint(1.5, 4)", "takes two integers"),
        ("optim.lr=choice()", "needs at least one value"),
    ],
)
def test_parse_search_errors(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_search(text)


def test_domains_are_ray_tune_domains():
    from ray import tune

    lr = parse_search("optim.lr=loguniform(1e-4,1e-1)").domain()
    assert isinstance(lr, tune.search.sample.Float) and 1e-4 <= lr.sample() <= 1e-1
    assert parse_search("x.y=grid(1, 2)").domain() == {"grid_search": [1, 2]}


def test_flags_become_tune_keys():
    rest, tuned, address = split_flags(
        [
            "optim.lr=0.1",
            "--search",
            "optim.lr=loguniform(1e-4,1e-1)",
            "--search=data.global_batch_size=choice(8,16)",
            "--samples",
            "6",
            "--metric=valid/mIoU",
            "--mode",
            "max",
            "--address",
            "ray://head:10001",
            "--epochs",
            "2",
        ]
    )
    assert rest == ["optim.lr=0.1", "--epochs", "2"] and address == "ray://head:10001"
    cfg, _ = load_config(SMALL, rest + tuned)
    assert cfg.tune.search == {"optim.lr": "loguniform(1e-4,1e-1)", "data.global_batch_size": "choice(8,16)"}
    assert (cfg.tune.num_samples, cfg.tune.metric, cfg.tune.mode, cfg.loop.epochs) == (6, "valid/mIoU", "max", 2)


def test_searches_are_checked_against_the_config():
    cfg, _ = load_config(SMALL, ['tune.search={"optim.lrr": "uniform(0.1, 0.2)"}'])
    with pytest.raises(ConfigError, match="did you mean optim.lr"):
        searches_of(cfg)
    cfg, _ = load_config(SMALL, ['tune.search={"data.global_batch_size": "choice(8, 9)"}'])
    with pytest.raises(ConfigError, match="data.global_batch_size=9 is not divisible by 2"):
        searches_of(cfg)
    cfg, _ = load_config(SMALL)
    with pytest.raises(ConfigError, match="nothing to search"):
        searches_of(cfg)
    with pytest.raises(ConfigError, match="tune.scheduler='pbt' is not one of asha, fifo"):
        load_config(SMALL, ["tune.scheduler=pbt"])


# ------------------------------------------------------------ trials
def test_lr_scaling():
    cfg, _ = load_config(SMALL, ["tune.lr_scaling=linear"])
    assert scaled_lr(0.1, 32, cfg.tune, 8) == pytest.approx(0.4)
    cfg = with_values(cfg, {"tune.lr_scaling": "sqrt"})
    assert scaled_lr(0.1, 32, cfg.tune, 8) == pytest.approx(0.2)
    cfg = with_values(cfg, {"tune.reference_batch_size": 32})
    assert scaled_lr(0.1, 8, cfg.tune, 16) == pytest.approx(0.05)
    cfg = with_values(cfg, {"tune.lr_scaling": "none"})
    assert scaled_lr(0.1, 32, cfg.tune, 8) == 0.1


def test_trial_config_applies_values_then_scaling():
    cfg, _ = load_config(SMALL, ["tune.lr_scaling=linear", "optim.lr=0.01"])
    trial = trial_config(cfg, {"data.global_batch_size": 16, "optim.lr": 0.02})
    assert trial.data.global_batch_size == 16 and trial.optim.lr == pytest.approx(0.04)
    assert cfg.optim.lr == 0.01  # the base is untouched


def test_reports_per_trial():
    cfg, _ = load_config(SMALL, ["loop.epochs=7"])
    assert reports_per_trial(cfg) == 7
    cfg = with_values(cfg, {"loop.max_steps": 100, "checkpoint.every_steps": 30})
    assert reports_per_trial(cfg) == 4
    cfg = with_values(cfg, {"tune.max_t": 3})
    assert reports_per_trial(cfg) == 3
    cfg = with_values(cfg, {"tune.max_t": 0, "loop.max_steps": 0})
    with pytest.raises(ConfigError, match="set tune.max_t"):
        reports_per_trial(cfg)


def test_max_concurrent_trials_fits_the_workers_and_clamps_what_does_not(capsys):
    cfg, _ = load_config(SMALL, ["scaling.num_workers=2", "scaling.runtime=cpu"])
    assert max_concurrent_trials(cfg, [{"CPU": 8}]) == 4  # the trial's driver reserves no CPU
    assert max_concurrent_trials(cfg, [{"CPU": 2}]) == 1  # the documented sweep on a 2-CPU machine
    cfg = with_values(cfg, {"scaling.cpus_per_worker": 2.0})
    assert max_concurrent_trials(cfg, [{"CPU": 3}] * 4) == 2  # one 2-CPU worker per 3-CPU node, not 12 / 4 = 3
    cfg = with_values(cfg, {"scaling.cpus_per_worker": 1.0, "scaling.runtime": "cuda"})
    assert max_concurrent_trials(cfg, [{"CPU": 64, "GPU": 4}]) == 2
    cfg = with_values(cfg, {"scaling.runtime": "cpu", "tune.max_concurrent": 2})
    assert max_concurrent_trials(cfg, [{"CPU": 2}]) == 1
    assert "--max-concurrent 2: only 1 trial(s) of 2 worker(s) fit" in capsys.readouterr().out
    assert max_concurrent_trials(cfg, [{"CPU": 8}]) == 2


def test_format_table():
    text = format_table([{"trial": "a", "lr": 0.012345, "m": None}], ["trial", "lr", "m"])
    lines = text.splitlines()
    assert lines[0].split() == ["trial", "lr", "m"] and lines[2].split() == ["a", "0.01235", "-"]


# -------------------------------------------------------- integration
def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def mshnet_data(tmp_path_factory):
    from raytpu.jobs.mshnet import JOB

    root = tmp_path_factory.mktemp("tune-data")
    JOB.synthesize(root, n=24, size=32, seed=0)
    return root


def test_asha_sweep_stops_bad_trials_and_writes_a_runnable_best_config(ray_session, tmp_path, mshnet_data):
    """An lr=1e-12 trial's training loss is its initial model's loss; the trained trials (grid
    order: they run first, 2 at a time) recorded lower losses at the first rung, so ASHA
    must stop both untrained trials there, whatever order the rest of the sweep takes."""
    from raytpu.driver import commands
    from raytpu.driver.tune import sweep

    flags = ["--search", "optim.lr=grid(0.05, 0.03, 1e-12, 1e-12)", "--samples", "1", "--metric", "train/loss"]
    flags += ["--mode", "min", "--max-concurrent", "2", "--grace-period", "1", "--name", "asha"]
    rest, tuned, _ = split_flags(TINY + [f"data.path={mshnet_data}", f"run.storage_path={tmp_path}", *flags])
    cfg, job = load_config(SMALL, rest + tuned)
    summary = sweep(cfg, job)

    rows = read_rows(tmp_path / "asha" / "results.csv")
    assert len(rows) == 4
    untrained = [r for r in rows if float(r["optim.lr"]) < 1e-6]
    trained = [r for r in rows if float(r["optim.lr"]) > 1e-6]
    assert all(r["status"] == "stopped early" and r["reports"] == "1" for r in untrained), rows
    assert any(r["status"] == "done" and r["reports"] == "3" for r in trained), rows
    assert max(float(r["train/loss"]) for r in trained) < min(float(r["train/loss"]) for r in untrained), rows
    assert all(0 < float(r["goodput"].rstrip("%")) <= 100 for r in rows), rows  # each trial's, in the table

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trial_runs = sorted((tmp_path / "asha" / "runs").iterdir())
    assert len(trial_runs) == 4
    events = EventAccumulator(str(trial_runs[0] / "tensorboard"))
    events.Reload()
    assert events.PluginTagToContent("hparams") and "valid/Fa" in events.Tags()["scalars"]
    summaries = {row["trial"]: json.loads((tmp_path / "asha" / "runs" / row["trial"] / "summary.json").read_text())
                 for row in rows}  # fmt: skip
    outcomes = {"done": "completed", "stopped early": "stopped"}
    assert all(summaries[row["trial"]]["status"] == outcomes[row["status"]] for row in rows), summaries
    assert all(summary["best_checkpoint"].startswith("checkpoint_") for summary in summaries.values()), summaries

    best = Path(summary["best_config"])
    cfg_best, job_best = load_config(best, [f"run.storage_path={tmp_path / 'best'}", "loop.epochs=1"])
    assert cfg_best.optim.lr in (0.05, 0.03) and cfg_best.scaling.runtime == "auto"
    assert Path(cfg_best.data.path) == mshnet_data
    trained = commands.train(cfg_best, job_best, local=True)  # runnable by raytpu train (the loop of a Ray run)
    assert trained.best_checkpoint and Path(trained.best_checkpoint, "model.safetensors").is_file()


def test_interrupted_sweep_resumes_without_rerunning_finished_trials(ray_session, tmp_path, mshnet_data):
    """A sweep whose folder is an S3 bucket: Ctrl-C after the first trial finished, then the same
    command: the finished trial keeps its files untouched, the other one runs, and results.csv has
    both, all in the bucket."""
    from raytpu.storage.run_folder import RunFolder
    from tests.stores import BUCKET

    storage = f"s3://{BUCKET}/tune-{tmp_path.name}"
    address = ray_session.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "raytpu.cli", "tune", SMALL, *TINY, "loop.epochs=2"]
    command += [f"data.path={mshnet_data}", f"run.storage_path={storage}", "--address", address]
    command += [
        "--search",
        "optim.lr=grid(0.05, 1e-12)",
        "--samples",
        "1",
        "--max-concurrent",
        "1",
        "--scheduler",
        "fifo",
    ]
    command += ["--name", "resume"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.monotonic() + 300
    for line in first.stdout:
        seen.append(line)
        if " done" in line and line.split()[0].endswith("_00000"):
            first.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(seen[-30:])
    first.communicate(timeout=120)
    runs = RunFolder(f"{storage}/resume/runs")
    finished = RunFolder(runs.uri(next(name for name in runs.children() if name.endswith("_00000"))))
    before = objects(finished)

    # the resume on a Ray instance of its own, beside the session's: it uses only its own
    alone = {key: value for key, value in env.items() if key != "RAY_ADDRESS"}
    second = subprocess.run(command, cwd=ROOT, env=alone, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming sweep" in second.stdout
    shown = second.stdout + second.stderr
    assert "multiple active Ray instances" not in shown and "Traceback" not in shown, shown[-3000:]
    results = tmp_path / "results.csv"
    results.write_text(RunFolder(f"{storage}/resume").read_text("results.csv"))
    rows = read_rows(results)
    assert sorted((r["optim.lr"], r["status"], r["reports"]) for r in rows) == [
        ("0.05", "done", "2"),
        ("1e-12", "done", "2"),
    ]
    after = objects(finished)
    changed = [p for p in after if before.get(p) != after[p] and "tfevents" not in p]
    assert not changed, changed
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(finished.uri("tensorboard")).Reload()  # TensorBoard reads s3:// (with boto3)
    assert events.Scalars("train/loss"), events.Tags()


def objects(folder) -> dict[str, tuple]:
    """Every object under a bucket folder: its size and time of writing."""
    import pyarrow.fs as pafs

    infos = folder.fs.get_file_info(pafs.FileSelector(folder.base, recursive=True))
    return {info.path: (info.size, info.mtime) for info in infos if info.type == pafs.FileType.File}
