"""Run folders in a bucket (``s3://``, ``gs://``), against real storage servers on loopback: the
filesystem layer, a run on GCS that resumes past a damaged newest checkpoint, and tests of
checkpoints in a bucket. (A run on a multi-node cluster killed and resumed from S3:
``tests/test_multinode.py``; tune, launch, submit and Ray Data with a bucket: in their own test files.)"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from raytpu import cli
from raytpu.errors import ConfigError
from raytpu.storage.filesystems import check_location, diagnose, is_remote, join
from raytpu.storage.run_folder import RunFolder, local_copy
from tests.stores import BUCKET, free_port


# ------------------------------------------------------------------ the layer
@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("hdfs://namenode/runs", "use a local folder, gs://bucket/prefix or s3://bucket/prefix"),
        ("s3:///runs", "names no bucket; write s3://BUCKET/PREFIX"),
        ("s3://b/runs?access_key=AKIA&secret_key=x", "carries access_key, secret_key: credentials never go"),
    ],
)
def test_a_location_is_a_folder_or_a_bucket_without_credentials(location, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        check_location(location, "run.storage_path")
    check_location("gs://b/runs", "run.storage_path")
    check_location("relative/runs", "run.storage_path")


def test_locations_join_and_errors_say_what_to_do():
    assert join("gs://b/runs/", "r1", "tensorboard") == "gs://b/runs/r1/tensorboard"
    assert join("/x/runs", "r1") == "/x/runs/r1" and not is_remote("/x") and is_remote("s3://b")
    assert (
        join("s3://b/runs?endpoint_override=h:9&scheme=http", "r1")
        == "s3://b/runs/r1?endpoint_override=h:9&scheme=http"
    )
    assert "the bucket 'b' does not exist" in diagnose("s3://b/x", "AWS Error NO_SUCH_BUCKET during PutObject")
    assert "may not write there" in diagnose("s3://b/x", "AWS Error ACCESS_DENIED during CreateMultipartUpload")
    assert "no valid credentials" in diagnose("gs://b/x", "Could not create a OAuth2 access token")
    assert "does not answer" in diagnose("s3://b/x", "AWS Error NETWORK_CONNECTION: Could not connect")
    assert "does not exist" in diagnose("gs://b/x", "Not Found error_info={metadata={http_status_code=404}}")


def test_digits_of_a_name_a_request_id_or_a_time_are_no_status_code():
    """The probe object's random name, the store's request id and the connect time each held a
    "401", "403" or "404" now and then: the diagnosis must not change with them."""
    refused = (
        "When initiating multiple part upload for key 'runs/.raytpu-probe-9c2afb61f403' in bucket 'b': AWS Error "
        "NETWORK_CONNECTION during CreateMultipartUpload operation: curlCode: 7, Could not connect to server; "
        "Details: Failed to connect to 127.0.0.1:1 after 401 ms: Could not connect to server"
    )
    assert "does not answer" in diagnose("s3://b/x", refused)
    missing = "AWS Error NO_SUCH_BUCKET during PutObject: The specified bucket does not exist (Request ID: mCM401)"
    assert "the bucket 'b' does not exist" in diagnose("s3://b/x", missing)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_run_folder_in_a_bucket_reads_writes_stages_and_fetches(stores, scheme, tmp_path):
    folder = RunFolder(f"{scheme}://{BUCKET}/folder-{tmp_path.name}")
    assert folder.remote and folder.read_text("config.yaml") is None and not folder.exists()
    folder.write_text("config.yaml", "a: 1\n")
    (folder.local("tensorboard") / "events.1").write_text("first")
    folder.sync("tensorboard")
    (folder.local("tensorboard") / "events.1").write_text("first and second")
    folder.sync("tensorboard")
    assert folder.read_text("config.yaml") == "a: 1\n" and folder.children() == ["config.yaml", "tensorboard"]
    assert folder.read_text("tensorboard/events.1") == "first and second"
    with local_copy(folder.uri("tensorboard")) as fetched:
        assert (fetched / "events.1").read_text() == "first and second"
    assert not fetched.exists()  # a copy, removed after use
    folder.fs.delete_dir(folder.path("tensorboard"))  # a prefix without a folder marker (GCS: no 404)
    assert folder.children() == ["config.yaml"]


def test_tensorboard_reads_the_events_of_a_run_in_s3(stores, tmp_path):
    """What docs/storage.md tells a user: ``tensorboard --logdir s3://...`` (boto3, the endpoint from
    ``AWS_ENDPOINT_URL``) reads the events a bucket run synced there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    folder = RunFolder(f"s3://{BUCKET}/board-{tmp_path.name}")
    with SummaryWriter(log_dir=str(folder.local("tensorboard"))) as writer:
        for step in range(3):
            writer.add_scalar("train/loss", 1.0 / (step + 1), step)
    folder.sync("tensorboard")
    events = EventAccumulator(folder.uri("tensorboard")).Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [0, 1, 2]


def test_a_run_in_s3_shows_its_curves_while_an_epoch_runs(stores, tmp_path):
    """``logging.flush_every_s``: the toy job in-process, its run folder in S3, one 32-step epoch of
    0.1 s steps; at step 24 (2.4 s in), the bucket's events already hold the steps logged about a
    second before, although nothing evaluated yet (the other copy-up point)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raytpu.config import load_config
    from raytpu.hooks import Callback
    from raytpu.runtime import make_runtime
    from raytpu.worker.loop import Trainer
    from raytpu.worker.reporting import FolderReporter

    location = f"s3://{BUCKET}/live-{tmp_path.name}"
    seen: dict[int, list[int]] = {}

    class ReadTheBucket(Callback):
        def on_step_end(self, trainer, step: int) -> None:
            if step == 24:
                events = EventAccumulator(join(location, "tensorboard")).Reload()
                seen[step] = [event.step for event in events.Scalars("train/loss")] if events.Tags()["scalars"] else []

    overrides = ["job.name=tests.toy_job", "job.samples=256", "job.step_sleep=0.1", "data.global_batch_size=8"]
    overrides += ["loop.log_every=1", "logging.progress_bar=false", "logging.flush_every_s=0.5", "loop.epochs=1"]
    cfg, job = load_config(None, overrides)
    runtime = make_runtime("cpu", "fp32", 1, 0, 0)
    reporter = FolderReporter(tmp_path / "checkpoints")
    Trainer(cfg, job, runtime, location, tmp_path, reporter, callbacks=[ReadTheBucket()]).fit()
    assert seen[24] and max(seen[24]) >= 10, seen  # copied up mid-epoch, by the logger's own thread
    final = EventAccumulator(join(location, "tensorboard")).Reload().Scalars("train/loss")
    assert max(event.step for event in final) == 32


# ------------------------------------------------------------------ GCS on the session's instance
def train(config: Path, name: str, *extra: str) -> int:
    common = ["scaling.num_workers=2", "data.global_batch_size=8", "loop.log_every=1", "logging.progress_bar=false",
              "checkpoint.num_to_keep=2"]  # fmt: skip
    common.append(f"run.storage_path=gs://{BUCKET}/runs")
    return cli.main(["train", str(config), *common, f"run.name={name}", *extra])


@pytest.mark.integration
def test_a_run_in_gcs_resumes_past_a_damaged_checkpoint_and_tests_from_the_bucket(ray_session, tmp_path, capfd):
    """The toy job on 2 workers into gs:// for 2 epochs (checkpoints 8 and 16 in the bucket); the
    newest loses a worker's RNG file (a copy that stopped part-way); the same command, one epoch
    longer, skips it with a warning, resumes from step 8 and completes; Ray Train's retention
    deletes checkpoints of the bucket without an error; ``raytpu test`` reads one from it."""
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\n")
    assert train(config, "gcs", "loop.epochs=2") == 0
    folder = RunFolder(f"gs://{BUCKET}/runs/gcs")
    checkpoints = [n for n in folder.children() if n.startswith("checkpoint_0")]
    assert checkpoints == ["checkpoint_00000008", "checkpoint_00000016"]
    folder.fs.delete_file(folder.path("checkpoint_00000016", "rng", "rank_1.pt"))
    capfd.readouterr()
    assert train(config, "gcs", "loop.epochs=3") == 0
    out, err = capfd.readouterr()
    assert "skipping checkpoint" in out + err and "incomplete (the RNG state of 1 of 2 workers)" in out + err
    assert f"resumed from gs://{BUCKET}/runs/gcs/checkpoint_00000008 at step 8" in out, out[-2000:]
    assert "Caught exception when deleting" not in out + err  # retention on GCS: prefixes without markers
    kept = [n for n in folder.children() if n.startswith("checkpoint_0")]
    assert "checkpoint_00000024" in kept and len(kept) <= 3, kept
    assert folder.read_text("config.yaml") and folder.children("tensorboard")
    best = out.split("best checkpoint:")[1].split()[0]
    assert best.startswith(f"gs://{BUCKET}/runs/gcs/checkpoint_")
    summary = json.loads(folder.read_text("summary.json"))  # the run's records in the bucket
    assert summary["status"] == "completed" and summary["step"] == 24
    assert [attempt["outcome"] for attempt in summary["attempts"]] == ["completed", "completed"]
    assert folder.uri(summary["best_checkpoint"]) == best and summary["latest_checkpoint"] == "checkpoint_00000024"
    assert cli.main(["runs", folder.location]) == 0
    listed = capfd.readouterr().out
    assert f"{summary['best_checkpoint']}" in listed and "<- best" in listed and "completed at " in listed, listed
    assert cli.main(["runs", f"gs://{BUCKET}/runs"]) == 0
    assert "gcs " in capfd.readouterr().out
    bucket_run = [f"run.storage_path=gs://{BUCKET}/runs", "run.name=gcs"]  # --checkpoint best: the run's own
    assert cli.main(["test", str(config), "--checkpoint", "best", *bucket_run]) == 0
    tested = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert set(tested) == {"test/mse"}


# ------------------------------------------------------------------ the store lost mid-run
@pytest.mark.integration
def test_a_store_lost_mid_run_ends_it_in_one_line_and_its_last_checkpoint_resumes(ray_session, tmp_path, capfd):
    """A second S3 endpoint (moto keeps its buckets in this process, so it serves the same bucket)
    goes away after the run's first checkpoint: the run ends with one line naming the store; once
    the endpoint is back, the same command resumes from that checkpoint and completes."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    storage = f"s3://{BUCKET}/lost-{tmp_path.name}?endpoint_override=127.0.0.1:{port}&scheme=http"
    folder = RunFolder(f"s3://{BUCKET}/lost-{tmp_path.name}/lost")  # through the session's endpoint
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\n")
    argv = ["train", str(config), "scaling.num_workers=1", "data.global_batch_size=8", "loop.epochs=3",
            "job.step_sleep=0.2", "logging.progress_bar=false", f"run.storage_path={storage}",
            "run.name=lost"]  # fmt: skip
    stopper = when_written(folder, "checkpoint_00000008/meta.json", server.stop)
    capfd.readouterr()
    assert cli.main(argv) == 1
    stopper.join()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytpu: error: the run's store stopped answering"), err[-10:]
    assert "the last complete checkpoint in it is kept" in err[0]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        assert cli.main(argv) == 0
    finally:
        server.stop()
    out = capfd.readouterr().out
    assert f"/lost/checkpoint_00000008?endpoint_override=127.0.0.1:{port}&scheme=http at step 8" in out, out


def when_written(folder: RunFolder, name: str, action) -> threading.Thread:
    """Run ``action`` once ``folder`` holds ``name``."""

    def wait() -> None:
        deadline = time.monotonic() + 600  # a guard against a hang only
        while not folder.exists(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        action()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread
