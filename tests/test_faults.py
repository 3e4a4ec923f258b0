"""Runs that go wrong, on real Ray Train (2 local CPU workers, the toy job): a worker that raises,
a worker SIGKILLed mid-run, a signal to the driver. Each ends in a resumed run whose final
weights equal those of an uninterrupted one, and the console shows none of Ray Train's internals."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raytpu import cli
from raytpu.worker import checkpoint as ckpt

pytestmark = pytest.mark.integration

#: 64 samples / global batch 8 = 8 steps per epoch, 3 epochs; a checkpoint (with an eval) at each
#: epoch end; 0.15 s per step so that a run can be hit in the middle
COMMON = ["scaling.num_workers=2", "data.global_batch_size=8", "loop.epochs=3", "loop.log_every=1",
          "job.step_sleep=0.15", "logging.progress_bar=false", "checkpoint.num_to_keep=5"]  # fmt: skip
#: lines of Ray Train's own machinery that must not reach the console at default verbosity
RAY_INTERNALS = ["Reporting training result", "Checkpoint successfully created", "repeated", "[Gloo]",
                 "PreemptionWatcher", "Token authentication", "log_deduplication", "TrainController"]  # fmt: skip


def train(tmp_path: Path, name: str, *extra: str) -> int:
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\n")
    where = [f"run.storage_path={tmp_path / 'results'}", f"run.name={name}"]
    return cli.main(["train", str(config), *COMMON, *where, *extra])


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir) / ckpt.MODEL)


def latest_checkpoint(run_dir: Path) -> Path:
    return max(p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))


def assert_same_weights(tmp_path: Path, name: str) -> None:
    straight, other = weights(tmp_path / "results" / "straight"), weights(tmp_path / "results" / name)
    for key in straight:
        torch.testing.assert_close(other[key], straight[key], rtol=0, atol=0)


def when_checkpointed(run_dir: Path, step: int, action) -> threading.Thread:
    """Run ``action`` once ``run_dir`` holds the checkpoint of ``step``."""

    def wait() -> None:
        deadline = time.monotonic() + 120
        while not (run_dir / f"checkpoint_{step:08d}" / ckpt.META).is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        action()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def straight(ray_session, tmp_path_factory):
    """The uninterrupted run, and what the console showed of it."""
    tmp_path = tmp_path_factory.mktemp("faults")
    return tmp_path, train(tmp_path, "straight")


def test_the_console_shows_no_ray_internals_and_a_tie_has_the_same_best_as_local(straight, capfd):
    """Every evaluation of this run scores the same: Ray Train and the local processes keep and
    choose checkpoints by one rule, whose tie goes to the newer checkpoint (step 16 of 8 and 16)."""
    tmp_path, code = straight
    assert code == 0
    tie = ["loop.epochs=2", "job.constant_metric=0.5"]
    code = train(tmp_path, "console", *tie)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    shown = out + err
    assert "raytpu: train console on the local Ray instance: 2 cpu worker(s), fp32, 4 samples per worker" in shown
    assert '"valid/mse": 0.5' in out
    leaked = [line for line in shown.splitlines() if any(mark in line for mark in RAY_INTERNALS)]
    assert not leaked, leaked
    assert train(tmp_path, "console-local", *tie, "--local") == 0
    local_out = capfd.readouterr().out
    best = {run: text.split("best checkpoint:")[1].split()[0] for run, text in (("ray", out), ("local", local_out))}
    assert best == {
        "ray": str(tmp_path / "results" / "console" / "checkpoint_00000016"),
        "local": str(tmp_path / "results" / "console-local" / "checkpoint_00000016"),
    }


def test_a_raising_worker_ends_the_run_and_the_rerun_resumes(straight, capfd):
    tmp_path, _ = straight
    capfd.readouterr()
    assert train(tmp_path, "raised", "job.fail_at_step=13") == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert "Traceback" in "\n".join(err), err[-20:]  # the failing rank's traceback, then one line:
    assert err[-1].startswith("raytpu: error: rank ") and "fault injected by job.fail_at_step=13" in err[-1]
    assert train(tmp_path, "raised") == 0
    assert "resumed from" in capfd.readouterr().out
    assert_same_weights(tmp_path, "raised")


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(straight, capfd):
    """SIGKILL to one worker process after the first checkpoint: Ray Train restarts the worker
    group (checkpoint.max_failures=1) from that checkpoint, and the run ends as if never hit."""
    tmp_path, _ = straight
    pids = tmp_path / "pids"
    pids.mkdir()
    killed: list[int] = []

    def kill_one() -> None:
        killed.append(int(min(pids.iterdir()).name))
        os.kill(killed[0], signal.SIGKILL)

    thread = when_checkpointed(tmp_path / "results" / "killed", 8, kill_one)
    code = train(tmp_path, "killed", "checkpoint.max_failures=1", f"job.pid_dir={pids}")
    thread.join()
    assert code == 0, capfd.readouterr().err[-3000:]
    assert len(list(pids.iterdir())) == 4, killed  # two workers, then two new ones after the kill
    assert "resumed from" in capfd.readouterr().out
    assert_same_weights(tmp_path, "killed")


def test_a_signal_to_the_driver_checkpoints_stops_and_the_same_command_resumes(straight, capfd):
    tmp_path, _ = straight
    run_dir = tmp_path / "results" / "signalled"
    thread = when_checkpointed(run_dir, 8, lambda: os.kill(os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    code = train(tmp_path, "signalled")
    thread.join()
    out, err = capfd.readouterr()
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert time.monotonic() - started < 120
    assert "SIGTERM received" in err and "run the same command again to resume" in err.strip().splitlines()[-1]
    latest = latest_checkpoint(run_dir)
    meta = ckpt.read_meta(latest)
    assert 8 < meta["step"] < 24 and (meta["reason"] == "stop" or meta["step"] == 16), meta
    if meta["reason"] == "stop":  # never the best: it has no eval
        assert str(latest) not in out.split("best checkpoint:")[1].splitlines()[0]
    assert train(tmp_path, "signalled") == 0
    assert f"resumed from {latest}" in capfd.readouterr().out
    assert_same_weights(tmp_path, "signalled")
