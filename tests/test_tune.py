"""``raytpu tune``: search-string parsing and the sweep's pure parts without Ray; an ASHA sweep,
its best config, an interrupted-then-resumed Optuna sweep and a PBT sweep of the toy job (the
searcher's and scheduler's state is the point, not the model) on the session's local Ray instance."""

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

from raytpu import cli
from raytpu.config import ConfigError, load_config, with_values
from raytpu.driver.search import Search, mutations_of, parse_search, searches_of, split_flags
from raytpu.driver.trial import scaled_lr, trial_config
from raytpu.driver.tune import format_table, max_concurrent_trials, reports_per_trial

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "jobs/mshnet/small.yaml")
#: the toy job's trials: 64 samples, 8 a step (8 steps an epoch), one worker of half a CPU (two at once)
TINY = [
    "loop.epochs=2",
    "scaling.num_workers=1",
    "scaling.cpus_per_worker=0.5",
    "data.global_batch_size=8",
    "logging.progress_bar=false",
    "job.step_sleep=0.02",  # a step that takes time: each trial's goodput shows in its table
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
    with pytest.raises(ConfigError, match="tune.scheduler='hyperband' is not one of asha, fifo, pbt"):
        load_config(SMALL, ["tune.scheduler=hyperband"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--search-alg", "optuna", "--search", "optim.lr=grid(0.1, 0.01)"], "optim.lr is a grid(), Tune's own"),
        (["--search-alg", "optuna", "--scheduler", "pbt"], "--scheduler pbt draws its population at random"),
        (["--search-alg", "bayes"], "tune.search_alg='bayes' is not one of random, optuna"),
        (["--mutate", "optim.weight_decay=uniform(0, 0.1)"], "is what --scheduler pbt perturbs"),
        (["--scheduler", "pbt", "--mutate", "optim.lr=grid(0.1, 0.2)"], "give choice(...) or a range, not grid()"),
        (["--scheduler", "pbt", "--mutate", "optim.lrr=uniform(0.1, 0.2)"], "did you mean optim.lr"),
        (["--scheduler", "pbt", "--quantile-fraction", "0.7"], "tune.quantile_fraction must be at most 0.5"),
    ],
)
def test_a_search_algorithm_or_scheduler_that_cannot_take_the_search_is_one_line(flags, message, tmp_path, capsys):
    search = [] if "--search" in flags else ["--search", "optim.lr=loguniform(1e-3, 1e-1)"]
    assert cli.main(["tune", SMALL, f"run.storage_path={tmp_path}", *search, *flags]) == 2
    out, err = capsys.readouterr()
    err = err.strip()
    assert err.startswith("raytpu: error:") and "\n" not in err and message in err, err
    assert "raytpu: train " not in out, out  # said before the plan: no Ray started or joined for it


def test_optuna_missing_is_one_line_naming_the_extra(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optuna" else real(name, *a))
    flags = ["--search", "optim.lr=loguniform(1e-3, 1e-1)", "--search-alg", "optuna"]
    assert cli.main(["tune", SMALL, f"run.storage_path={tmp_path}", *flags]) == 2
    assert f"needs Optuna: pip install -e '{ROOT}[optuna]'" in capsys.readouterr().err


def test_pbt_perturbs_the_lr_within_its_searched_range_unless_told_otherwise():
    rest, tuned, _ = split_flags(["--scheduler", "pbt", "--search", "optim.lr=grid(0.05, 1e-4)"])
    cfg, _ = load_config(SMALL, rest + tuned)
    assert mutations_of(cfg, searches_of(cfg)) == [Search("optim.lr", "loguniform", (1e-4, 0.05))]
    rest, tuned, _ = split_flags(["--scheduler", "pbt", "--search", "loop.epochs=choice(1, 2)"])
    cfg, _ = load_config(SMALL, [*rest, *tuned, "optim.lr=0.01"])
    assert mutations_of(cfg, searches_of(cfg)) == [Search("optim.lr", "loguniform", (0.001, 0.1))]
    rest, tuned, _ = split_flags(
        ["--scheduler", "pbt", "--search", "loop.epochs=choice(1, 2)", "--mutate", "optim.weight_decay=choice(0, 0.1)"]
    )
    cfg, _ = load_config(SMALL, rest + tuned)
    assert mutations_of(cfg, searches_of(cfg)) == [Search("optim.weight_decay", "choice", (0, 0.1))]


def test_batch_sizes_that_cannot_fit_the_devices_memory_are_left_out_of_the_search(capsys):
    """The memory estimate of each value against a (fake) device's memory: the batches that cannot
    fit are named and dropped; none fitting is one error; no known memory (a CPU) changes nothing."""
    from raytpu.config.plan import Facts, make_plan
    from raytpu.driver.search import within_memory

    lm = str(ROOT / "jobs/causal_lm/small.yaml")
    model = ["job.model_config.hidden_size=64", "job.model_config.num_hidden_layers=2", "job.seq_len=64"]
    fake_device = ["scaling.runtime=cpu", "scaling.num_workers=1", "scaling.device_memory_gb=0.1"]
    rest, tuned, _ = split_flags(["--search", "data.global_batch_size=choice(2, 8, 64, 512)", *model, *fake_device])
    cfg, job = load_config(lm, rest + tuned)
    plan = make_plan(cfg, Facts(mode="train"))
    [kept] = within_memory(searches_of(cfg), plan, job)
    assert kept.key == "data.global_batch_size" and 2 in kept.args and 512 not in kept.args, kept
    line = capsys.readouterr().out.strip()
    assert line.startswith("raytpu: data.global_batch_size: ") and "512 (about" in line and line.endswith("left out")
    tiny = make_plan(with_values(cfg, {"scaling.device_memory_gb": 0.001}), Facts(mode="train"))
    with pytest.raises(ConfigError, match="data.global_batch_size: no value fits 90% of the 0.001 GB"):
        within_memory(searches_of(cfg), tiny, job)
    unknown = make_plan(with_values(cfg, {"scaling.device_memory_gb": 0.0}), Facts(mode="train"))
    assert within_memory(searches_of(cfg), unknown, job) == searches_of(cfg)


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


def all_cpus_free(ray, wait_s: float = 30) -> bool:
    """Whether every CPU of the Ray instance is free again within ``wait_s`` (Ray frees them asynchronously)."""
    ends = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources().get("CPU", 0):
        if time.monotonic() > ends:
            return False
        time.sleep(1)
    return True


@pytest.fixture(scope="module")
def tune_ray(ray_session):
    """The session's Ray restarted with its dashboard for this module's sweeps: Ray Train removes
    the worker-group reservation of a trial that Tune stops or pauses (ASHA, PBT) once Ray's state
    API, which the dashboard serves, says the trial's controller is gone; without it each stopped
    trial kept its CPUs, and a PBT sweep's restarted trials waited for them for ever."""
    from raytpu.cluster.connect import connect

    ray_session.shutdown()
    connect("local", dashboard=True)
    yield ray_session
    ray_session.shutdown()
    connect("local", dashboard=False)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """The toy job's config (no dropout: an untrained trial's loss is its initial model's) and data folder."""
    root = tmp_path_factory.mktemp("tune-toy")
    config = root / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job, dropout: 0.0}}\ndata: {{path: {root}}}\n")
    return config


def test_asha_sweep_stops_bad_trials_and_writes_a_runnable_best_config(tune_ray, tmp_path, toy):
    """An lr=1e-12 trial's training loss is its initial model's loss; the trained trials (grid
    order: they run first, 2 at a time) recorded lower losses at the first rung, so ASHA
    must stop the untrained trial there, whatever order the rest of the sweep takes."""
    from raytpu.driver import commands
    from raytpu.driver.tune import sweep

    flags = ["--search", "optim.lr=grid(0.05, 0.03, 1e-12)", "--samples", "1", "--metric", "train/loss"]
    flags += ["--mode", "min", "--max-concurrent", "2", "--grace-period", "1", "--name", "asha"]
    rest, tuned, _ = split_flags(TINY + [f"run.storage_path={tmp_path}", *flags])
    cfg, job = load_config(toy, rest + tuned)
    summary = sweep(cfg, job)
    assert all_cpus_free(tune_ray), tune_ray.available_resources()  # no trial's reservation left

    rows = read_rows(tmp_path / "asha" / "results.csv")
    assert len(rows) == 3
    untrained = [r for r in rows if float(r["optim.lr"]) < 1e-6]
    trained = [r for r in rows if float(r["optim.lr"]) > 1e-6]
    assert all(r["status"] == "stopped early" and r["reports"] == "1" for r in untrained), rows
    assert any(r["status"] == "done" and r["reports"] == "2" for r in trained), rows
    assert max(float(r["train/loss"]) for r in trained) < min(float(r["train/loss"]) for r in untrained), rows
    assert all(0 < float(r["goodput"].rstrip("%")) <= 100 for r in rows), rows  # each trial's, in the table

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trial_runs = sorted((tmp_path / "asha" / "runs").iterdir())
    assert len(trial_runs) == 3
    events = EventAccumulator(str(trial_runs[0] / "tensorboard"))
    events.Reload()
    assert events.PluginTagToContent("hparams") and "valid/mse" in events.Tags()["scalars"]
    summaries = {row["trial"]: json.loads((tmp_path / "asha" / "runs" / row["trial"] / "summary.json").read_text())
                 for row in rows}  # fmt: skip
    outcomes = {"done": "completed", "stopped early": "stopped"}
    assert all(summaries[row["trial"]]["status"] == outcomes[row["status"]] for row in rows), summaries
    assert all(summary["best_checkpoint"].startswith("checkpoint_") for summary in summaries.values()), summaries

    best = Path(summary["best_config"])
    cfg_best, job_best = load_config(best, [f"run.storage_path={tmp_path / 'best'}", "loop.epochs=1"])
    assert cfg_best.optim.lr in (0.05, 0.03) and cfg_best.scaling.runtime == "auto"
    assert Path(cfg_best.data.path) == toy.parent
    trained = commands.train(cfg_best, job_best, local=True)  # runnable by raytpu train (the loop of a Ray run)
    assert trained.best_checkpoint and Path(trained.best_checkpoint, "model.safetensors").is_file()


def crashes(output: str) -> list[str]:
    """The tracebacks in a command's output, less a Ray worker's own as its instance shuts down (its
    SIGTERM handler raises SystemExit in whatever it was doing, and Ray relays that to the driver)."""
    return [block for block in output.split("Traceback (most recent call last):")[1:] if "sigterm_handler" not in block]


def test_an_interrupted_optuna_sweep_resumes_its_search_without_rerunning_finished_trials(tune_ray, tmp_path, toy):
    """A TPE sweep of 3 trials in an S3 bucket (2 drawn at random, then 1 by TPE): Ctrl-C after the
    second trial finished, then the same command: the finished trials keep their files untouched,
    and every trial's values are those of one uninterrupted search (Optuna's TPE, as raytpu seeds
    it, replayed on the metrics the trials reported): the resumed sweep went on with the
    searcher's state, not a fresh one's draws."""
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    from raytpu.driver.search import tpe_sampler
    from raytpu.storage.run_folder import RunFolder
    from tests.stores import BUCKET

    storage = f"s3://{BUCKET}/tune-{tmp_path.name}"
    address = tune_ray.get_runtime_context().gcs_address
    command = [sys.executable, "-m", "raytpu.cli", "tune", str(toy), *TINY, "loop.epochs=1"]
    command += [f"run.storage_path={storage}", "--address", address]
    command += ["--search", "optim.lr=loguniform(1e-4, 0.1)", "--search-alg", "optuna", "--samples", "3"]
    command += ["--max-concurrent", "1", "--scheduler", "fifo", "--metric", "train/loss", "--mode", "min"]
    command += ["--name", "resume"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, done = [], set()
    deadline = time.monotonic() + 900  # a guard against a hang only: a loaded machine runs trials slowly
    for line in first.stdout:
        seen.append(line)
        words = line.split()
        if len(words) > 1 and words[-1] == "done":
            done.add(words[0])
        if len(done) == 2:
            first.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "".join(seen[-30:])
    first.communicate(timeout=120)
    runs = RunFolder(f"{storage}/resume/runs")
    before = {name: objects(RunFolder(runs.uri(name))) for name in done}

    # the resume: the same command again, on the same Ray instance (its --address)
    second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming sweep" in second.stdout
    shown = second.stdout + second.stderr
    assert "multiple active Ray instances" not in shown and not crashes(shown), shown[-3000:]
    results = tmp_path / "results.csv"
    results.write_text(RunFolder(f"{storage}/resume").read_text("results.csv"))
    rows = read_rows(results)
    assert [(r["status"], r["reports"]) for r in rows] == [("done", "1")] * 3, rows
    started = {r["trial"]: json.loads(RunFolder(runs.uri(r["trial"])).read_text("goodput.json")) for r in rows}
    rows.sort(key=lambda r: started[r["trial"]]["commands"][0]["started"])  # the order the searcher drew them
    for name, files in before.items():
        after = objects(RunFolder(runs.uri(name)))
        assert not [p for p in after if files.get(p) != after[p] and "tfevents" not in p], name

    replay = OptunaSearch(sampler=tpe_sampler(0, 3))
    replay.set_search_properties("train/loss", "min", {"optim.lr": tune.loguniform(1e-4, 0.1)})
    for index, row in enumerate(rows):
        assert replay.suggest(str(index))["optim.lr"] == pytest.approx(float(row["optim.lr"]), rel=1e-9), index
        replay.on_trial_complete(str(index), {"train/loss": float(row["train/loss"])})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(runs.uri(next(iter(done)), "tensorboard")).Reload()  # TensorBoard reads s3://
    assert events.Scalars("train/loss"), events.Tags()


def test_pbt_has_a_lagging_trial_go_on_from_the_better_one_s_checkpoint_with_a_perturbed_lr(tune_ray, tmp_path, toy):
    """Two trials, lr 0.05 and 1e-6: at a perturbation the lagging one takes the other's latest
    checkpoint (a copy in its own folder) with a perturbed lr and goes on from its step; the
    exploit is in its folder and the table, and its checkpoints carry the lr it trained with at each
    step, which best.yaml writes out for the winner."""
    from raytpu.driver.tune import sweep
    from raytpu.records import summary as run_summary
    from raytpu.storage.run_folder import RunFolder

    flags = ["--search", "optim.lr=grid(0.05, 1e-6)", "--samples", "1", "--scheduler", "pbt"]
    flags += ["--perturbation-interval", "1", "--quantile-fraction", "0.5", "--metric", "train/loss", "--mode", "min"]
    flags += ["--max-concurrent", "2", "--name", "pbt"]
    # the two trials train side by side: an exploit needs both trials' scores while both run, and
    # a busy machine started the second one after the first had ended (each waits for the other's
    # first step; steps of 0.4 s)
    pids = tmp_path / "pids"
    pids.mkdir()
    slow = ["loop.epochs=4", "job.step_sleep=0.4", f"job.pid_dir={pids}", "job.wait_for_pids=2"]
    slow.append(f"run.storage_path={tmp_path}")
    rest, tuned, _ = split_flags([*TINY, *slow])
    cfg, job = load_config(toy, rest + tuned + split_flags(flags)[1])
    summary = sweep(cfg, job)

    rows = {row["trial"]: row for row in read_rows(tmp_path / "pbt" / "results.csv")}
    assert all(row["status"] == "done" and row["reports"] == "4" for row in rows.values()), rows
    runs = tmp_path / "pbt" / "runs"
    exploits = {path.parent.name: json.loads(path.read_text()) for path in runs.glob("*/exploits.json")}
    assert exploits, rows  # the lagging trial went on from the other's checkpoint at least once
    trial, taken = next(iter(exploits.items()))
    last = taken[-1]  # an exploit ends the trial's own line of checkpoints: the last one's line is left
    assert last["from_trial"] != trial and last["checkpoint"].startswith(str(runs / last["from_trial"]))
    copied = runs / trial / "exploited" / f"{len(taken)}-{Path(last['checkpoint']).name}"
    assert json.loads((copied / "meta.json").read_text())["step"] == last["step"]
    lr = float(last["values"]["optim.lr"])
    assert lr > 0 and lr not in (0.05, 1e-6)  # perturbed, or drawn again from its range
    own = run_summary.checkpoints(RunFolder(runs / trial))
    assert all(meta["step"] > last["step"] for meta in own), own  # none of the line it left
    final = max(meta["step"] for name in exploits | {r["trial"]: 0 for r in rows.values()} for meta in
                run_summary.checkpoints(RunFolder(runs / name)))  # fmt: skip
    if last["step"] < final:  # it went on from there with its own lr, after the taken history
        assert own and all(meta["lr_steps"][-1] == [last["step"], lr] for meta in own), own
        assert own[0]["lr_steps"][0][0] == 0 and len(own[0]["lr_steps"]) >= 2, own
    table = next(row for row in rows.values() if row["trial"] == trial)
    assert table["exploits"].startswith(f"{len(exploits[trial])}, last from ")
    best = load_config(summary["best_config"])[0]
    assert best.optim.lr in (0.05, 1e-6) and all(int(step) > 0 for step in best.optim.lr_changes)


def test_an_exploit_whose_checkpoint_the_better_trial_has_deleted_since_takes_its_oldest_newer_one(tmp_path):
    """Tune chose the better trial's step-24 checkpoint, but the lagging trial restarted late and
    the better one's retention has deleted it: the copy is of its step-32 one (not of its newest,
    40), and says so; with no newer one left the copy fails on the missing folder."""
    from raytpu.driver.trial import copy_surviving
    from raytpu.storage.run_folder import RunFolder

    better, lagging = RunFolder(tmp_path / "t0"), RunFolder(tmp_path / "t1")
    for step in (32, 40):
        better.write_text(f"checkpoint_{step:08d}/meta.json", json.dumps({"step": step}))
    pointer = {"trial": "t0", "checkpoint": better.uri("checkpoint_00000024"), "step": 24}
    taken, copy = copy_surviving(pointer, better, lagging, 1)
    assert taken == {"trial": "t0", "checkpoint": better.uri("checkpoint_00000032"), "step": 32}
    assert copy == lagging.uri("exploited/1-checkpoint_00000032")
    assert json.loads(Path(copy, "meta.json").read_text())["step"] == 32
    assert lagging.children("exploited") == ["1-checkpoint_00000032"]
    with pytest.raises(FileNotFoundError):
        copy_surviving({**pointer, "checkpoint": better.uri("checkpoint_00000048")}, better, lagging, 2)
    assert lagging.children("exploited") == ["1-checkpoint_00000032"]


def test_a_trial_that_ended_after_an_exploit_is_named_by_its_own_folder_and_its_last_exploit_s_values(tmp_path):
    """Tune restores a trial's last result with the checkpoint it takes: until it reports again, its
    result carries the other trial's id and values. The row takes the trial's folder (named by its
    id) and its last exploit's values; a folder of a sweep begun before (Tune's long names) falls
    back to the result's id."""
    from types import SimpleNamespace

    from raytpu.driver.tune import trial_id_of, values_of

    sweep = SimpleNamespace(dir=str(tmp_path))
    (tmp_path / "runs" / "ab12c_00001").mkdir(parents=True)
    taken = [{"from_trial": "ab12c_00000", "step": 16, "values": {"optim.lr": 0.04}}]
    (tmp_path / "runs" / "ab12c_00001" / "exploits.json").write_text(json.dumps(taken))
    leader_s = {"trial_id": "ab12c_00000", "config": {"optim.lr": 0.05}}
    result = SimpleNamespace(path=str(tmp_path / "tune" / "ab12c_00001"), metrics=leader_s, config=leader_s["config"])
    assert trial_id_of(result) == "ab12c_00001"
    assert values_of(sweep, "ab12c_00001", result) == {"optim.lr": 0.04}
    older = SimpleNamespace(path="/x/run_trial_ab12c_00000_0_optim_lr=0.05", metrics=leader_s, config=None)
    assert trial_id_of(older) == "ab12c_00000" and values_of(sweep, "ab12c_00000", older) == {}


def test_a_pbt_winner_s_schedule_comes_from_its_newest_state_its_own_or_the_one_it_took_last(tmp_path):
    """An exploit at a trial's last report leaves it no checkpoint of its own after it: its final
    state, and the lr schedule best.yaml writes, is the one it took."""
    from raytpu.driver.tune import lr_schedule
    from raytpu.storage.run_folder import RunFolder

    trial = tmp_path / "t1"
    taken = trial / "exploited" / "1-checkpoint_000003"
    taken.mkdir(parents=True)
    (taken / "meta.json").write_text(json.dumps({"step": 30, "lr_steps": [[0, 0.05]]}))
    exploit = {"from_trial": "t0", "checkpoint": str(tmp_path / "t0" / "checkpoint_000003"), "step": 30}
    (trial / "exploits.json").write_text(json.dumps([{**exploit, "values": {"optim.lr": 0.032}}]))
    assert lr_schedule(RunFolder(trial)) == {"optim.lr": 0.05, "optim.lr_changes": {}}
    own = trial / "checkpoint_000004"
    own.mkdir()
    (own / "meta.json").write_text(json.dumps({"step": 40, "lr_steps": [[0, 0.05], [30, 0.032]]}))
    assert lr_schedule(RunFolder(trial)) == {"optim.lr": 0.05, "optim.lr_changes": {30: 0.032}}


def objects(folder) -> dict[str, tuple]:
    """Every object under a bucket folder: its size and time of writing."""
    import pyarrow.fs as pafs

    infos = folder.fs.get_file_info(pafs.FileSelector(folder.base, recursive=True))
    return {info.path: (info.size, info.mtime) for info in infos if info.type == pafs.FileType.File}
