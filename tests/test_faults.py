"""Runs that go wrong, on real Ray Train (2 local CPU workers, the toy job): a worker that raises,
a worker SIGKILLed mid-run, a signal to the driver. Each ends in a resumed run whose final
weights equal those of an uninterrupted one, and the console shows none of Ray Train's internals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raytpu import cli
from raytpu.driver.signals import StopOnSignal
from raytpu.records import checkpoints as ckpt
from raytpu.records import goodput as records

pytestmark = pytest.mark.integration

#: 64 samples / global batch 8 = 8 steps per epoch, 3 epochs; a checkpoint (with an eval) at each
#: epoch end; 0.3 s per step so that a run can be hit in the middle; known delays in loading (10 ms a
#: sample, 4 samples per worker and step) and in each checkpoint write (0.4 s) for the goodput, long
#: beside the loop's own time even on a busy machine (the suite runs two test processes at once)
COMMON = ["scaling.num_workers=2", "data.global_batch_size=8", "loop.epochs=3", "loop.log_every=8",
          "job.step_sleep=0.3", "logging.progress_bar=false", "checkpoint.num_to_keep=5",
          "job.item_sleep=0.01", "job.checkpoint_sleep=0.4"]  # fmt: skip
#: what rank 0 of the uninterrupted run must show in each category: 24 steps, 3 checkpoints
INJECTED = {"productive": 24 * 0.3, "input": 24 * 4 * 0.01, "checkpointing": 3 * 0.4}
#: every evaluation reports the same mse, whatever the weights
TIE = ["job.constant_metric=0.5"]
#: the same run without its delays: what it computes, not how long it takes
NO_DELAYS = ["job.step_sleep=0", "job.item_sleep=0", "job.checkpoint_sleep=0"]
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
        deadline = time.monotonic() + 600  # a guard against a hang only
        while not (run_dir / f"checkpoint_{step:08d}" / ckpt.META).is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        action()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def console() -> Iterator[dict[str, str]]:
    """What the block writes to standard output and standard error (``out``, ``err``: filled at its
    end), through ``sys.stdout`` and ``sys.stderr`` and at file descriptors 1 and 2 (where Ray's
    own processes write): what ``capfd`` shows a test, for a fixture shared by a module's tests."""
    shown: dict[str, str] = {}
    with tempfile.TemporaryFile("w+", buffering=1) as out, tempfile.TemporaryFile("w+", buffering=1) as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield shown
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            for name, sink in (("out", out), ("err", err)):
                sink.seek(0)
                shown[name] = sink.read()


@pytest.fixture(scope="module")
def straight(ray_session, tmp_path_factory):
    """The uninterrupted run, every evaluation of which scores the same (a tie: the weights are
    those of any other run here), its wall time and what the console showed of it."""
    tmp_path = tmp_path_factory.mktemp("faults")
    started = time.time()
    with console() as shown:
        code = train(tmp_path, "straight", *TIE)
    return tmp_path, code, time.time() - started, shown


def goodput(run_dir: Path) -> dict:
    return json.loads((run_dir / records.RECORD).read_text())


def test_the_goodput_breakdown_has_each_delay_in_its_category_and_adds_up_to_the_wall_time(straight, capfd):
    """Each injected delay is in its category (the exact accounting, on a clock that moves only with
    the delays: tests/test_goodput.py), and the categories add up to the command's wall time, which
    lies within the test's."""
    tmp_path, code, wall, _ = straight
    assert code == 0
    record = goodput(tmp_path / "results" / "straight")
    categories = record["categories"]
    for name, seconds in INJECTED.items():
        assert categories[name] >= seconds, (name, categories)
    assert sum(INJECTED.values()) < record["wall_s"] <= wall
    assert sum(categories.values()) == pytest.approx(record["wall_s"], rel=1e-9)
    assert categories["lost"] == 0, categories
    # the start-up is the driver's, the workers' set-up, the build and the first step, each marked:
    # its length is the machine's, not a test's to bound
    parts = records.startup_parts(record["commands"][0])
    assert {"driver", "worker set-up", "build", "first step"} <= set(parts), parts
    assert categories["startup"] == pytest.approx(sum(parts.values()), rel=1e-9) and parts["driver"] > 0, parts
    assert record["goodput"] == pytest.approx(categories["productive"] / record["wall_s"])


def test_the_console_shows_no_ray_internals_and_a_tie_has_the_same_best_as_local(straight, capfd):
    """Every evaluation of the straight run scores the same: Ray Train and the local processes keep
    and choose checkpoints by one rule, whose tie goes to the newer checkpoint (step 24 of 8, 16, 24)."""
    tmp_path, code, _, shown = straight
    out, err = shown["out"], shown["err"]
    assert code == 0, err[-3000:]
    assert "raytpu: train straight on the local Ray instance: 2 cpu worker(s), fp32, 4 samples per worker" in out + err
    assert '"valid/mse": 0.5' in out
    leaked = [line for line in (out + err).splitlines() if any(mark in line for mark in RAY_INTERNALS)]
    assert not leaked, leaked
    assert train(tmp_path, "tie-local", *TIE, *NO_DELAYS, "--local") == 0
    local_out = capfd.readouterr().out
    best = {run: text.split("best checkpoint:")[1].split()[0] for run, text in (("ray", out), ("local", local_out))}
    assert best == {
        "ray": str(tmp_path / "results" / "straight" / "checkpoint_00000024"),
        "local": str(tmp_path / "results" / "tie-local" / "checkpoint_00000024"),
    }


def test_a_raising_worker_ends_the_run_and_the_rerun_resumes(straight, capfd):
    tmp_path, *_ = straight
    capfd.readouterr()
    assert train(tmp_path, "raised", "job.fail_at_step=13") == 1
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert "Traceback (most recent call last)" not in out + err, err[-3000:]  # one line, the traceback in the log
    assert "Error in training function" not in out + err, err[-3000:]
    log = tmp_path / "results" / "raised" / "logs" / f"rank_{lines[-1].split()[3].rstrip(':')}.log"
    assert (
        lines[-1] == f"raytpu: error: rank {log.stem[5:]}: RuntimeError: fault injected by job.fail_at_step=13 "
        f"(traceback: {log})"
    ), lines[-3:]
    assert "Traceback (most recent call last)" in log.read_text() and "train_step" in log.read_text()
    assert json.loads((tmp_path / "results" / "raised" / "summary.json").read_text())["status"] == "failed"
    assert train(tmp_path, "raised") == 0
    assert "resumed from" in capfd.readouterr().out
    assert_same_weights(tmp_path, "raised")
    record = goodput(tmp_path / "results" / "raised")
    assert [command["outcome"] for command in record["commands"]] == ["failed", "completed"]
    summary = json.loads((tmp_path / "results" / "raised" / "summary.json").read_text())
    assert summary["status"] == "completed" and [a["outcome"] for a in summary["attempts"]] == ["failed", "completed"]
    assert summary["step"] == 24 and summary["best_checkpoint"].startswith("checkpoint_")
    # steps 9-12 (after the checkpoint of step 8) ran in the failed command and again in the resumed
    # one: lost, with the failed command's end; only 8 + 16 steps are productive
    assert record["categories"]["lost"] >= 4 * 0.3, record["categories"]
    assert [attempt["steps"] for command in record["commands"] for attempt in command["attempts"]] == [8, 16]
    assert record["categories"]["productive"] >= INJECTED["productive"], record["categories"]


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(straight, capfd):
    """SIGKILL to one worker process after the first checkpoint: Ray Train restarts the worker
    group from that checkpoint, and the run ends as if never hit. A budget of 2 failures: on a
    loaded machine Ray Train has counted the one kill twice (the other worker destroyed with its
    placement group while the group restarted: seen twice in whole-suite runs, open on issue 60)."""
    tmp_path, *_ = straight
    pids = tmp_path / "pids"
    pids.mkdir()
    killed: list[int] = []

    def kill_one() -> None:
        killed.append(int(min(pids.iterdir()).name))
        os.kill(killed[0], signal.SIGKILL)

    thread = when_checkpointed(tmp_path / "results" / "killed", 8, kill_one)
    code = train(tmp_path, "killed", "checkpoint.max_failures=2", f"job.pid_dir={pids}")
    thread.join()
    assert code == 0, capfd.readouterr().err[-3000:]
    assert len(list(pids.iterdir())) >= 4, killed  # two workers, then two new ones after the kill
    assert "resumed from" in capfd.readouterr().out
    assert_same_weights(tmp_path, "killed")
    record = goodput(tmp_path / "results" / "killed")  # one command, two worker groups (or three)
    assert len(record["commands"]) == 1 and len(record["commands"][0]["attempts"]) >= 2, record["commands"]
    assert record["categories"]["lost"] > 0 and record["categories"]["productive"] >= INJECTED["productive"]


def test_a_signal_to_the_driver_checkpoints_stops_and_the_same_command_resumes(straight, capfd):
    """Ctrl-C (SIGINT) to the driver once step 8 is checkpointed; the workers look for a stop at every
    step (loop.log_every=1) and checkpoint the step where they see it, without an eval, so never as
    the best. They see it at step 8 itself (already checkpointed) when it came before that step's
    look. SIGTERM has the same handler then; Ray Train's own SIGINT handler (which aborted the run
    at once) is never put in, and the process's handler is the same after the run as before it."""
    tmp_path, *_ = straight
    run_dir = tmp_path / "results" / "signalled"
    before = signal.getsignal(signal.SIGINT)
    handlers = []

    def interrupt() -> None:
        handlers.extend(signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGINT)

    thread = when_checkpointed(run_dir, 8, interrupt)
    code = train(tmp_path, "signalled", "loop.log_every=1")
    thread.join()
    out, err = capfd.readouterr()
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert "SIGINT received" in err and "run the same command again to resume" in err.strip().splitlines()[-1]
    assert handlers[0] == handlers[1] and isinstance(getattr(handlers[0], "__self__", None), StopOnSignal)
    assert signal.getsignal(signal.SIGINT) == before
    latest = latest_checkpoint(run_dir)
    meta = ckpt.read_meta(latest)
    assert 8 <= meta["step"] < 24, meta
    assert meta["reason"] == ("scheduled" if meta["step"] in (8, 16) else "stop"), meta
    if meta["reason"] == "stop":
        assert str(latest) not in out.split("best checkpoint:")[1].splitlines()[0]
    assert train(tmp_path, "signalled", "loop.log_every=1", *NO_DELAYS) == 0  # what it computes, not its time
    assert f"resumed from {latest}" in capfd.readouterr().out
    assert_same_weights(tmp_path, "signalled")
