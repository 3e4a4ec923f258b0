"""MSHNet and CDEIT small through real Ray Train: 2 local CPU workers, checkpoints, TensorBoard, test mode.
Each job trains through one ingest path and is tested through the other (MSHNet: torch then
Ray Data; CDEIT: Ray Data then torch), so that every run checks both. (The two paths' batches
side by side: tests/test_ingest_ray.py; failures, kills, signals and resumes: tests/test_faults.py.)"""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from raytpu import cli
from raytpu.config import load_config, with_values
from raytpu.driver import commands
from raytpu.records import checkpoints as ckpt
from raytpu.storage import tables as ingest
from tests.stores import BUCKET

pytestmark = pytest.mark.integration

#: CDEIT small made shallow and narrow: the ingest paths and the EMA are the point, not the model
CDEIT_SHALLOW = ["job.hidden_size=32", "job.num_heads=4", "job.scales=2", "job.stage_depth=1", "job.window_depth=1"]

#: MSHNet cut down (32x32 images, narrower and shallower stages): the run's machinery is the point
TINY = [
    "job.base_size=32",
    "job.crop_size=32",
    "job.blocks=1",
    "job.widths=[4,8,8,16,16]",
    "job.synth_n=40",
    "job.synth_size=32",
    "scaling.num_workers=2",
    "data.global_batch_size=8",
    "loop.log_every=1",
    "logging.progress_bar=false",
]


def configure(tmp_path: Path, name: str, *extra: str):
    cfg, job = load_config(
        "jobs/mshnet/small.yaml",
        [
            *TINY,
            f"data.path={tmp_path / 'data'}",
            f"run.storage_path={tmp_path / 'results'}",
            f"run.name={name}",
            *extra,
        ],
    )
    if not (tmp_path / "data").exists():  # made here: ./data/mshnet of the checkout must not be used
        job.synthesize(tmp_path / "data", **job.synth_options(cfg))
    return cfg, job


def scalars(run_dir: Path, tag: str) -> list[float]:
    return [event.value for event in scalar_events(run_dir, tag)]


def scalar_events(run_dir: Path, tag: str) -> list:
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events.Scalars(tag)


def actors_since(ray_session, started: float) -> list[str]:
    """The classes of the actors the session's instance started since ``started`` (seconds)."""
    actors = ray_session._private.state.actors().values()
    return [actor["ActorClassName"] for actor in actors if actor["StartTime"] >= started * 1000]


def test_mshnet_trains_on_two_workers_and_tests(ray_session, tmp_path, capsys):
    cfg, job = configure(tmp_path, "two-workers", "loop.epochs=4", "job.warm_epoch=-1")
    began = time.time()
    summary = commands.train(cfg, job)
    run_dir = Path(summary.run_dir)
    assert (run_dir / "config.yaml").is_file()
    assert Path(summary.best_checkpoint, "model.safetensors").is_file()
    losses = scalars(run_dir, "train/loss")
    assert len(losses) == 16  # 4 epochs x 32 train images / 8 per step
    # whether the recipe learns is bench/learning.py's, over seeds: 16 noisy steps decided it by chance
    assert all(math.isfinite(loss) for loss in losses), losses
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert any(tag.startswith("valid/") for tag in events.Tags()["images"])
    assert {"valid/mIoU", "valid/nIoU", "valid/Pd", "valid/Fa"} <= set(summary.metrics)
    # the session's instance: one node without an autoscaler (no node to drain: no preemption watcher)
    # and without a dashboard (no state API: no placement-group cleaner); the run reads no Ray
    # Dataset (no dataset manager)
    started = set(actors_since(ray_session, began))
    assert "TrainController" in started, started
    assert not started & {"PreemptionWatcher", "PlacementGroupCleaner", "DatasetManager"}, started

    # test mode through Ray Data (tables prepared from the same images): MSHNet validates on the
    # test split, so the same weights give the same numbers as the torch path's last evaluation
    ingest.prepare(job, tmp_path / "data", str(tmp_path / "pq"))
    cfg = with_values(
        cfg, {"data.path": str(tmp_path / "pq"), "data.loader": "ray", "checkpoint.weights": summary.latest_checkpoint}
    )
    metrics, _ = commands.test(cfg, job)
    for name in ("mIoU", "nIoU", "Pd", "Fa"):
        assert metrics[f"test/{name}"] == pytest.approx(summary.metrics[f"valid/{name}"], rel=1e-6, abs=1e-9)


def test_cdeit_trains_through_ray_data_on_two_workers_and_samples_in_test_mode(ray_session, tmp_path, capsys):
    """Ray Data from a bucket: the tables prepared into S3, and read from it by the workers (a
    bucket in data.path is read through Ray Data: no data.loader=ray needed)."""
    tables = f"s3://{BUCKET}/tables-{tmp_path.name}"
    cfg, job = load_config(
        "jobs/cdeit/small.yaml",
        [
            f"data.path={tables}",  # prepared into, and read from, the S3 server
            "data.materialize_mb=0",  # the streaming read (the other tests' sets are small: materialized)
            f"run.storage_path={tmp_path / 'results'}",
            "run.name=cdeit",
            "job.synth_n_train=32",
            "job.synth_n_valid=8",
            "job.synth_n_test=8",
            "job.sampling_steps=1",  # test mode's sampler: one step (its compiles: tests/test_xla.py)
            *CDEIT_SHALLOW,
            "loop.epochs=2",
            "loop.log_every=1",
            "data.global_batch_size=8",
            "logging.progress_bar=false",
        ],
    )
    job.synthesize(tmp_path / "cdeit", **job.synth_options(cfg))  # not ./data/cdeit of the checkout
    assert cli.main(["data", "prepare", "cdeit", "--src", str(tmp_path / "cdeit"), "--out", tables]) == 0
    began = time.time()
    summary = commands.train(cfg, job)
    assert "reading cdeit's parquet tables through Ray Data (data.loader=ray)" in capsys.readouterr().out
    assert Path(summary.best_checkpoint, "ema.safetensors").is_file()
    latest = ckpt.read_meta(Path(summary.latest_checkpoint))
    assert (latest["step"], latest["epoch"]) == (8, 2)  # 32 samples, 4 steps an epoch
    assert {event.step for event in scalar_events(Path(summary.run_dir), "train/loss")} == set(range(1, 9))
    assert "valid/val_loss" in summary.metrics
    started = actors_since(ray_session, began)
    assert "DatasetManager" in started, started  # the run reads Ray Datasets: their shards' actor stays

    torch_path = {"data.path": str(tmp_path / "cdeit"), "data.loader": "torch"}  # test mode through the torch path
    cfg = with_values(cfg, {**torch_path, "checkpoint.weights": summary.best_checkpoint})
    metrics, _ = commands.test(cfg, job)
    assert metrics["test/images"] == 8 and metrics["test/rmse"] > 0 and metrics["test/psnr"] > 0


def test_a_wait_for_resources_other_work_holds_gives_up_after_its_limit(ray_session):
    """Every CPU of the session's Ray held by another placement group: the run's wait for its
    workers ends after ``scaling.node_start_timeout_s`` in one line, instead of Ray Train's wait,
    which has no end."""

    from ray.util.placement_group import placement_group, remove_placement_group

    from raytpu.cluster.capacity import NodesNotStarted, read_offer, wait_for_nodes

    cpus = ray_session.cluster_resources()["CPU"]
    other = placement_group([{"CPU": cpus}])
    ray_session.get(other.ready(), timeout=60)
    try:
        with pytest.raises(NodesNotStarted, match="other work on the cluster holds what they need"):
            wait_for_nodes([{"CPU": 1.0}], "1 cpu worker(s)", 1.5, read_offer(this_machine=True), held_by_others=True)
    finally:
        remove_placement_group(other)


def test_another_job_s_workers_never_ask_another_instance_s_dashboard(ray_session):
    """The session's instance runs without a dashboard, yet Ray records 127.0.0.1:8265 as its
    state API: a worker of any job on it (here a second driver's, as a page's command is) must not
    ask whichever other instance serves a dashboard there, where Ray Train's placement-group
    cleaner found no controller and removed a live run's workers. Its look fails instead."""
    from tests.conftest import finish, start_python

    address = ray_session.get_runtime_context().gcs_address
    code = (
        "import ray\n"
        f"ray.init(address={address!r}, log_to_driver=False)\n"
        "@ray.remote(num_cpus=0)\n"
        "def state_api():\n"
        "    from ray.dashboard.utils import get_address_for_submission_client\n"
        "    return get_address_for_submission_client(None)\n"
        "print(ray.get(state_api.remote()))\n"
    )
    said = finish(start_python(["-c", code]), timeout=120)
    assert said.returncode == 0, said.stderr[-2000:]
    url = said.stdout.strip().splitlines()[-1]
    assert url.startswith("http://127.0.0.1:") and ":8265" not in url, url
    port = int(url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_tune_trial_on_an_instance_without_a_dashboard_starts_no_placement_group_cleaner(ray_session):
    """A Tune trial's process joined the session's instance through Ray, not raytpu's connect: it
    still knows the instance serves no state API, and leaves out Ray Train's placement-group
    cleaner, which would ask that API for ever (one left spinning for every trial)."""

    @ray_session.remote(num_cpus=0)
    def left_out() -> list[str]:
        from raytpu.driver.ray_trainer import idle_callbacks

        return [callback.__name__ for callback in idle_callbacks(has_datasets=True)]

    assert ray_session.get(left_out.remote(), timeout=120) == ["PlacementGroupCleanerCallback"]


def test_a_local_instance_s_log_monitor_looks_for_new_log_files_every_half_second(ray_session):
    """Ray's log monitor lists its logs folder ten times a second until it holds a thousand files;
    raytpu's local instance starts it listing every 0.5 s (the setting is the monitor's alone)."""
    import os

    logs = str(Path(ray_session._private.worker._global_node.get_session_dir_path()) / "logs")
    monitors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "log_monitor.py" in command and logs in command:
                monitors.append(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
    assert len(monitors) == 1, monitors
    assert b"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0" in monitors[0]
    assert "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD" not in os.environ


def test_a_local_instance_starts_no_python_worker_ahead_of_a_task(ray_session):
    """A raylet starts a Python worker a CPU, with no runtime environment, as the first driver joins;
    every raytpu job carries one (its connect's), so those never ran a task and only took CPU while
    the instance waited: raytpu's local instance starts none (the setting is the raylet's alone)."""
    import os

    node = ray_session._private.worker._global_node
    raylet = node.all_processes["raylet"][0].process.pid
    assert b"RAY_prestart_worker_first_driver=0" in Path(f"/proc/{raylet}/environ").read_bytes().split(b"\0")
    assert "RAY_prestart_worker_first_driver" not in os.environ
    without_job = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            idle = parent == raylet and Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::IDLE")
            if idle and b"RAY_TRAIN_ENABLE_PRINT_PATCH=0" not in Path(f"/proc/{pid}/environ").read_bytes():
                without_job.append(pid)
        except OSError:
            continue
    assert not without_job, without_job


def test_xla_s_warnings_stay_off_every_worker_s_console_unless_the_driver_s_environment_asks(ray_session):
    """raytpu's connect sets XLA's C++ log level for every worker of its job from the process start,
    before any library loads XLA (``raytpu.runtime.xla.quiet_xla_logs``); a level set in the
    driver's environment reaches the workers instead."""
    from tests.conftest import finish, start_python

    address = ray_session.get_runtime_context().gcs_address
    code = (
        "import os, ray\n"
        "from raytpu.cluster.connect import connect\n"
        "@ray.remote(num_cpus=0)\n"
        "def level():\n"
        "    return os.environ.get('TF_CPP_MIN_LOG_LEVEL')\n"
        "os.environ.pop('TF_CPP_MIN_LOG_LEVEL', None)\n"
        "for given in (None, '1'):\n"
        "    if given:\n"
        "        os.environ['TF_CPP_MIN_LOG_LEVEL'] = given\n"
        f"    connect({address!r}, quiet=True)\n"
        "    print('level', ray.get(level.remote()))\n"
        "    ray.shutdown()\n"
    )
    said = finish(start_python(["-c", code]), timeout=120)
    assert said.returncode == 0, said.stderr[-2000:]
    assert [line for line in said.stdout.splitlines() if line.startswith("level")] == ["level 2", "level 1"], said
