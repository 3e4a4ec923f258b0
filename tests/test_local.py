"""``raytpu train --local``: 2 local processes over gloo, no Ray. The run folder holds the same
checkpoint directories as a Ray run, a failed rank ends the run with one closing line, and the
same command resumes it to the same weights as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from raytpu import cli

COMMON = [
    "scaling.num_workers=2",
    "data.global_batch_size=8",
    "loop.epochs=2",
    "checkpoint.every_steps=3",
    "logging.progress_bar=false",
]


def train(tmp_path: Path, name: str, *extra: str) -> int:
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job, samples: 32}}\ndata: {{path: {tmp_path}}}\n")
    return cli.main(
        ["train", "--local", str(config), *COMMON, f"run.storage_path={tmp_path}", f"run.name={name}", *extra]
    )


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = sorted(p for p in run_dir.iterdir() if p.name.startswith("checkpoint_"))[-1]
    return load_file(latest / "model.safetensors")


def test_two_local_processes_train_fail_resume_and_match(tmp_path, capfd):
    assert train(tmp_path, "straight") == 0
    out = capfd.readouterr().out
    run_dir = tmp_path / "straight"
    assert f"best checkpoint:   {run_dir}/checkpoint_" in out
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_"))
    assert len(kept) <= 3 and kept[-1] == "checkpoint_00000008"  # the 2 best by valid/mse and the latest
    latest = run_dir / kept[-1]
    assert {p.name for p in (latest / "rng").iterdir()} == {"rank_0.pt", "rank_1.pt"}  # both ranks' files
    best = out.split("best checkpoint:")[1].split()[0]
    assert cli.main(["runs", str(run_dir)]) == 0  # the run's checkpoints, best and latest marked
    listed = capfd.readouterr().out.splitlines()
    assert listed[0].startswith(f"run {run_dir}: completed at ") and "after 1 command(s), step 8" in listed[0]
    rows = {line.split()[0]: line for line in listed[2:]}
    assert list(rows) == kept and "valid/mse=" in rows[kept[-1]]
    assert rows[Path(best).name].endswith("<- best") or rows[Path(best).name].endswith("<- best, latest")
    assert rows[kept[-1]].endswith("latest")
    assert cli.main(["runs", str(tmp_path)]) == 0  # the runs under the storage path
    assert any(line.startswith("straight ") and " completed " in line for line in capfd.readouterr().out.splitlines())

    assert train(tmp_path, "resumed", "job.fail_at_step=5") == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("raytpu: error: rank ") and "fault injected" in err[-1], err[-5:]
    assert train(tmp_path, "resumed") == 0
    assert "resumed from" in capfd.readouterr().out
    straight, resumed = weights(run_dir), weights(tmp_path / "resumed")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)


def test_ctrl_c_checkpoints_stops_and_the_same_command_resumes(tmp_path):
    """SIGINT to the whole process group (what Ctrl-C does) of `raytpu train --local` after its
    first checkpoint: the workers checkpoint the current step and stop, exit 130; the same
    command resumes to the weights of an uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    slow = ["loop.epochs=4", "loop.log_every=1", "job.step_sleep=0.1"]
    assert train(tmp_path, "straight", *slow) == 0
    config = tmp_path / "toy.yaml"
    where = [f"run.storage_path={tmp_path}", "run.name=stopped"]
    command = [sys.executable, "-m", "raytpu.cli", "train", "--local", str(config), *COMMON, *slow, *where]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300  # a guard only: a loaded machine starts the workers slowly
    while not (tmp_path / "stopped" / "checkpoint_00000003").is_dir() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err[-2000:]
    assert "SIGINT received" in err and "run the same command again to resume" in err.strip().splitlines()[-1]
    assert train(tmp_path, "stopped", *slow) == 0
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "stopped")
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)


def test_the_group_meets_at_a_store_the_driver_holds_bound():
    """The rendezvous port is bound by the driver before any rank starts, and stays bound while the
    group runs: no other process can take it in between (one did, when rank 0 bound a port the driver
    had picked and let go)."""
    import errno
    import socket

    from torch.distributed import TCPStore

    from raytpu.driver.local import group_store

    store = group_store(2)
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", store.port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE
        else:
            raise AssertionError(f"port {store.port} was free while the store held it")
    client = TCPStore("127.0.0.1", store.port, 2, is_master=False)
    client.set("rank", "1")
    assert store.get("rank") == b"1"
