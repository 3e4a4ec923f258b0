"""MLflow and Weights & Biases (``logging.report_to``): a real MLflow tracking server on loopback
(SQLite store, started and stopped here) read back through MLflow's own client; W&B in offline
mode, its run file read back through ``wandb``'s own reader; ``--report_to`` as Transformers means
it; the one-line refusals before a run starts; a server lost mid-run."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from raytpu import cli
from raytpu.config import load_config, with_values
from raytpu.config.plan import tracking
from raytpu.driver.preflight import check_trackers
from raytpu.errors import ConfigError
from raytpu.hooks import Callback
from raytpu.records.trackers import TRACKERS
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.stores import free_port

TOY = ["job.name=tests.toy_job", "job.samples=64", "data.global_batch_size=8", "loop.log_every=2",
       "logging.progress_bar=false"]  # fmt: skip


class MLflowServer:
    """``mlflow server`` on loopback with an SQLite store in ``folder``."""

    def __init__(self, folder: Path, port: int = 0) -> None:
        self.folder, self.port = folder, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> MLflowServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db", "--workers", "1",
                   "--default-artifact-root", str(self.folder / "artifacts")]  # fmt: skip
        with open(self.folder / "server.log", "a") as log:  # the server keeps its own copy of the descriptor
            # no job runner: its ten huey consumers serve MLflow's GenAI jobs, which no run here starts
            env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        deadline = time.monotonic() + 600  # a guard against a hang only
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).close()
                # the store is made at the first request (the SQLite schema's migrations): seconds, over
                # the tracker's 10 s request limit on a loaded machine; made here, before a run asks
                urllib.request.urlopen(
                    f"{self.uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=120
                ).close()
                return self
            except OSError:
                assert self.process.poll() is None, (self.folder / "server.log").read_text()[-3000:]
                time.sleep(0.5)
        raise TimeoutError((self.folder / "server.log").read_text()[-3000:])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 15)  # the server and its uvicorn: one session
            try:
                self.process.wait(2)
            except subprocess.TimeoutExpired:  # uvicorn waits out its clients' keep-alive connections
                os.killpg(self.process.pid, 9)
                self.process.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = MLflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield started
    started.stop()


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


# ------------------------------------------------------------------ settings and refusals
@pytest.mark.parametrize(
    "words, report_to, tensorboard",
    [
        (["--report_to", "mlflow"], ["mlflow"], False),
        (["--report_to", "tensorboard,wandb"], ["tensorboard", "wandb"], True),
        (["--report_to", "none"], [], False),
        (["--report_to", "all"], ["tensorboard", "mlflow", "wandb"], True),  # every one installed here
    ],
)
def test_report_to_as_transformers_means_it(words, report_to, tensorboard):
    cfg, _ = load_config(None, [*TOY, *words])
    assert cfg.logging.report_to == report_to and cfg.logging.tensorboard == tensorboard


def test_tracker_settings_come_from_the_config_then_the_trackers_variables(tmp_path):
    cfg, _ = load_config(None, [*TOY, "--report_to", "mlflow,wandb", f"run.storage_path={tmp_path}"])
    environ = {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_EXPERIMENT_NAME": "lm", "WANDB_MODE": "offline"}
    assert tracking(cfg, environ) == {
        "logging.experiment": "lm",
        "logging.mlflow_tracking_uri": "http://mlflow:5000",
        "logging.wandb_mode": "offline",
    }
    defaults = tracking(cfg, {})
    assert defaults["logging.mlflow_tracking_uri"] == f"sqlite:///{tmp_path}/mlflow.db"
    assert defaults["logging.experiment"] == "raytpu" and defaults["logging.wandb_mode"] == "online"
    given = with_values(cfg, {"logging.experiment": "mine", "logging.mlflow_tracking_uri": "sqlite:///x.db"})
    assert tracking(given, environ) == {"logging.wandb_mode": "offline"}
    bucket = with_values(cfg, {"run.storage_path": "s3://bucket/runs"})
    with pytest.raises(ConfigError, match="is a bucket: set MLFLOW_TRACKING_URI"):
        tracking(bucket, {})


def test_a_tracking_server_that_does_not_answer_is_one_line_before_the_run(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    cfg, _ = load_config(None, [*TOY, "--report_to", "mlflow", f"logging.mlflow_tracking_uri={uri}"])
    with pytest.raises(ConfigError, match=f"the MLflow tracking server at {uri} does not answer"):
        check_trackers(cfg)


def test_wandb_online_without_a_login_is_one_line(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg, _ = load_config(None, [*TOY, "--report_to", "wandb", "logging.wandb_mode=online"])
    with pytest.raises(ConfigError, match="W&B online needs a login"):
        check_trackers(cfg)


# ------------------------------------------------------------------ MLflow through Ray
@pytest.mark.integration
def test_a_run_on_two_ray_workers_logs_to_mlflow_and_its_resume_continues_the_same_run(
    ray_session, server, tmp_path, capfd
):
    """The toy job on 2 Ray workers fails at step 13 and is run again (it resumes from step 8): one
    MLflow run holds the config as parameters, train/loss at every log step, the evaluations, the
    goodput, and the best checkpoint's location; it ends FINISHED."""
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\n")
    argv = ["train", str(config), "scaling.num_workers=2", "data.global_batch_size=8", "loop.epochs=3",
            "loop.log_every=2", "logging.progress_bar=false", f"run.storage_path={tmp_path}", "run.name=tracked",
            "--report_to", "tensorboard,mlflow", f"logging.mlflow_tracking_uri={server.uri}",
            "logging.experiment=raytpu-tests"]  # fmt: skip
    assert cli.main([*argv, "job.fail_at_step=13"]) == 1
    first = json.loads((tmp_path / "tracked" / TRACKERS).read_text())["mlflow"]["run_id"]
    assert cli.main(argv) == 0
    assert "resumed from" in capfd.readouterr().out
    assert json.loads((tmp_path / "tracked" / TRACKERS).read_text())["mlflow"]["run_id"] == first
    mlflow = client(server.uri)
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("raytpu-tests").experiment_id])
    assert [run.info.run_id for run in runs if run.info.run_name == "tracked"] == [first]  # one run, continued
    run = mlflow.get_run(first)
    assert run.info.status == "FINISHED"
    assert run.data.params["loop.epochs"] == "3" and run.data.params["scaling.num_workers"] == "2"
    steps = sorted({metric.step for metric in mlflow.get_metric_history(first, "train/loss")})
    history = [(m.step, m.timestamp, round(m.value, 4)) for m in mlflow.get_metric_history(first, "train/loss")]
    assert steps == list(range(2, 25, 2)), history  # every log step of both attempts, 8 samples x 3 epochs
    assert {metric.step for metric in mlflow.get_metric_history(first, "valid/mse")} == {8, 16, 24}
    assert 0 < run.data.metrics["goodput"] <= 1
    best = run.data.tags["best_checkpoint"]
    assert best.startswith(str(tmp_path / "tracked" / "checkpoint_")) and Path(best).is_dir()
    assert run.data.tags["latest_checkpoint"].endswith("checkpoint_00000024")


@pytest.mark.integration
def test_a_tracking_server_lost_mid_run_is_a_warning_and_the_run_finishes(tmp_path, capsys):
    """A server of its own, stopped at step 6 of 16 (in this process: the toy job, 0.05 s a step):
    one warning, the run completes, its TensorBoard events hold every step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lost = MLflowServer(tmp_path / "lost").start()

    class StopTheServer(Callback):
        def on_step_end(self, trainer, step: int) -> None:
            if step == 6:
                trainer.logger.drain_trackers()  # the tracker's run opened (on its own thread) and fed so far
                lost.stop()

    try:
        overrides = [*TOY, "job.samples=128", "job.step_sleep=0.05", "loop.epochs=1", "loop.log_every=1",
                     "--report_to", "tensorboard,mlflow", f"logging.mlflow_tracking_uri={lost.uri}"]  # fmt: skip
        cfg, job = load_config(None, overrides)
        run_dir = tmp_path / "run"
        trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, tmp_path, FolderReporter(run_dir),
                          callbacks=[StopTheServer()])  # fmt: skip
        trainer.fit()
    finally:
        lost.stop()
    out = capsys.readouterr().out
    assert out.count("warning: MLflow stopped taking this run's metrics") == 1, out[-3000:]
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, 17))


def test_a_tracker_down_at_start_is_a_warning_and_a_retried_attempt_keeps_its_tracker_run(tmp_path, capsys):
    """A tracking server that does not answer when a run starts: one warning, the run trains to its
    end. An attempt that fails before its first checkpoint, retried by the same command, continues
    the tracker run the first attempt opened (``trackers.json`` names the command), not a new one."""
    from raytpu.records.goodput import Command

    dead = f"http://127.0.0.1:{free_port()}"
    cfg, job = load_config(None, [*TOY, "--report_to", "tensorboard,mlflow", f"logging.mlflow_tracking_uri={dead}"])
    run_dir = tmp_path / "down"
    Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, tmp_path, FolderReporter(run_dir)).fit()
    out = capsys.readouterr().out
    assert out.count("warning: MLflow could not open this run's tracker run") == 1, out[-3000:]
    assert (run_dir / "checkpoint_00000008").is_dir()

    uri, run_dir, command = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "retried", Command()
    words = [*TOY, "--report_to", "mlflow", f"logging.mlflow_tracking_uri={uri}", "logging.experiment=retries"]

    def attempt(*extra: str) -> str:
        cfg, job = load_config(None, [*words, *extra])
        trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, tmp_path, FolderReporter(run_dir),
                          command=command)  # fmt: skip
        with contextlib.suppress(RuntimeError):
            trainer.fit()
        return json.loads((run_dir / TRACKERS).read_text())["mlflow"]["run_id"]

    first = attempt("job.fail_at_step=3")  # before the first checkpoint (step 8)
    assert not list(run_dir.glob("checkpoint_*"))
    assert attempt() == first
    mlflow = client(uri)
    runs = mlflow.search_runs([mlflow.get_experiment_by_name("retries").experiment_id])
    assert [run.info.run_id for run in runs] == [first] and runs[0].info.status == "FINISHED"
    steps = sorted(metric.step for metric in mlflow.get_metric_history(first, "train/loss"))
    assert steps == [2, 2, 4, 6, 8], steps  # the failed attempt's step 2, then the retry's


def test_a_sweeps_mlflow_run_ends_with_the_sweeps_outcome_and_a_dead_server_never_holds_it(tmp_path, capsys):
    from raytpu.driver.tune import Sweep, end_sweep_trackers, sweep_trackers

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    words = ["--report_to", "mlflow", f"logging.mlflow_tracking_uri={uri}", "run.name=failing",
             "logging.experiment=sweeps", f"run.storage_path={tmp_path}"]  # fmt: skip
    cfg, job = load_config(None, [*TOY, *words])
    parent = sweep_trackers(cfg, Sweep(cfg, job, []))
    end_sweep_trackers(cfg, parent, "FAILED")
    assert client(uri).get_run(parent["logging.mlflow_parent_run"]).info.status == "FAILED"
    gone = with_values(cfg, {"logging.mlflow_tracking_uri": f"http://127.0.0.1:{free_port()}"})
    end_sweep_trackers(gone, parent, "FAILED", timeout_s=5)
    assert "warning: MLflow did not take the sweep's end" in capsys.readouterr().err


# ------------------------------------------------------------------ W&B offline
def wandb_records(path: Path) -> list:
    """The records of a W&B run file, parsed with W&B's own protobuf classes. The file is a LevelDB
    log (W&B's format since its first releases): a 7-byte header (``:W&B``, magic, version), then
    32 KiB blocks of chunks, each a 7-byte header (checksum, length, type: 1 whole, 2 first, 3
    middle, 4 last) and its bytes; a block's last 6 bytes or fewer are padding."""
    from wandb.proto import wandb_internal_pb2

    data, records, partial = path.read_bytes(), [], b""
    assert data[:4] == b":W&B", data[:7]
    position, block = 7, 32768
    while position + 7 <= len(data):
        left = block - position % block
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or kind == 0:
            position += left
            continue
        partial += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(partial)
            records.append(record)
            partial = b""
    return records


def test_wandb_offline_holds_the_history_and_a_resume_continues_the_run_id(tmp_path, monkeypatch):
    """The toy job in this process with ``WANDB_MODE=offline`` semantics (``logging.wandb_mode``): an
    epoch, then the same run one epoch longer (it resumes from the first epoch's checkpoint): one W&B
    run id, a run file per attempt, every log step's loss in their history, the config as the run's
    config (the first attempt's, kept), the best checkpoint in its summary."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    base = [*TOY, "--report_to", "wandb", "logging.wandb_mode=offline", "logging.experiment=raytpu-tests",
            "run.name=offline"]  # fmt: skip

    def fit(epochs: int) -> None:
        cfg, job = load_config(None, [*base, f"loop.epochs={epochs}"])
        Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, tmp_path, FolderReporter(run_dir)).fit()

    fit(1)
    run_id = json.loads((run_dir / TRACKERS).read_text())["wandb"]["run_id"]
    # W&B names an offline run's folder by the second it started: a retry (seconds later on Ray)
    # starting in the same second as the first attempt would share its folder
    time.sleep(1.05 - time.time() % 1)
    fit(2)
    assert json.loads((run_dir / TRACKERS).read_text())["wandb"]["run_id"] == run_id
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2, sorted((run_dir / "wandb").iterdir())  # one per attempt, one run id
    steps, config, summary = [], {}, {}
    for record in [record for path in files for record in wandb_records(path)]:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            if "train/loss" in items:
                steps.append(int(items["_step"]))
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "summary":
            summary.update(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update}
            )
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16], steps  # 8 steps an epoch, logged every 2
    assert config["loop.epochs"] == 1 and config["job.name"] == "tests.toy_job"  # the first attempt's
    assert summary["best_checkpoint"].startswith(str(run_dir / "checkpoint_"))
    assert summary["latest_checkpoint"] == str(run_dir / "checkpoint_00000016")


# ------------------------------------------------------------------ sweeps
def test_a_sweep_is_one_mlflow_run_and_each_trial_is_its_child(server, tmp_path):
    """``raytpu tune``'s driver makes the sweep's MLflow run (the same one when the sweep resumes),
    each trial's tracker hangs its run under it, and the sweep's run ends with the sweep."""
    from raytpu.driver.tune import Sweep, end_sweep_trackers, sweep_trackers
    from raytpu.records.trackers import open_trackers
    from raytpu.storage.run_folder import RunFolder

    words = ["--report_to", "mlflow,wandb", f"logging.mlflow_tracking_uri={server.uri}", "run.name=swept",
             "logging.experiment=raytpu-sweeps", f"run.storage_path={tmp_path}"]  # fmt: skip
    cfg, job = load_config(None, [*TOY, *words])
    sweep = Sweep(cfg, job, [])
    parent = sweep_trackers(cfg, sweep)
    assert parent["logging.wandb_group"] == "swept-tune"
    assert sweep_trackers(cfg, sweep) == parent  # a resumed sweep: the same run
    trial = with_values(cfg, {**parent, "logging.report_to": ["mlflow"], "run.name": "trial_1"})
    trackers = open_trackers(trial.logging, RunFolder(tmp_path / "trial_1"), "trial_1", False, print)
    trackers.scalars({"valid/mse": 0.5}, 8)
    trackers.close(completed=True)
    end_sweep_trackers(cfg, parent)
    mlflow = client(server.uri)
    child = mlflow.get_run(json.loads((tmp_path / "trial_1" / TRACKERS).read_text())["mlflow"]["run_id"])
    assert child.data.tags["mlflow.parentRunId"] == parent["logging.mlflow_parent_run"]
    assert child.data.metrics["valid/mse"] == 0.5 and child.info.status == "FINISHED"
    sweep_run = mlflow.get_run(parent["logging.mlflow_parent_run"])
    assert sweep_run.info.run_name == "swept-tune" and sweep_run.info.status == "FINISHED"
