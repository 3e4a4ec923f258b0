"""A full disk, for real: a 2 MB tmpfs mounted in a private mount namespace (``unshare -m``, as
root), filled by each way a run writes (torch.save's C++ writer, safetensors, DCP shards, a staged
folder copied in, a JSON record, TensorBoard events). Each failure reads as one line naming the
folder and the space left, never as the writer's own message (``unexpected pos 576 vs 534``, a
list of errno tuples). And runs whose folder is on a 20 MB tmpfs that another program fills: on
local processes and on Ray workers under FSDP2, one console line, then resumed once there is room."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytpu import cli
from tests.conftest import ROOT

SCRIPT = 'mount -t tmpfs -o size=2m tmpfs "$1" && exec "$2" -m tests.full_disk_probe "$1" "$3"'


def test_every_way_a_checkpoint_writes_says_a_full_disk_in_one_line(tmp_path):
    full, spare = tmp_path / "full", tmp_path / "spare"
    full.mkdir()
    spare.mkdir()
    command = ["unshare", "-m", "sh", "-c", SCRIPT, "sh", str(full), sys.executable, str(spare)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "mount" in done.stderr and not done.stdout:
        pytest.skip(f"no private mount namespace with a tmpfs here (root is needed): {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(said) == {"torch.save", "safetensors", "copy", "json", "dcp", "tensorboard"}
    assert "Traceback" not in done.stderr, done.stderr[-3000:]  # TensorBoard's writing thread included
    for writer, line in said.items():
        what = "the TensorBoard events" if writer == "tensorboard" else "the checkpoint"
        assert line.startswith(f"cannot write {what} at "), (writer, line)
        assert "no space left on its disk (0 MB free)" in line, (writer, line)
        assert "\n" not in line and "Errno" not in line and "unexpected pos" not in line, (writer, line)
        assert "rerun the same command" in line


def test_a_full_disk_anywhere_in_an_error_s_chain_is_the_one_line_and_a_worker_relays_it(tmp_path):
    """A record the run writes (goodput's, Ray Train's state) that meets a full disk, and the error
    raised while handling it: one line naming the run folder and, once the run has a checkpoint, the
    room the next one needs; relayed by a Ray worker as marked text."""
    import errno

    from raytpu.errors import FIXABLE_MARK, fixable_line
    from raytpu.records.checkpoints import full_disk_in

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("cleanup failed too") from None
    except RuntimeError as exc:
        found = full_disk_in(exc, tmp_path)
    assert found is not None and str(found).startswith(f"cannot write the run's records at {tmp_path}: no space left")
    assert fixable_line(RuntimeError(f"{FIXABLE_MARK}{found}")) == str(found)
    assert full_disk_in(OSError(errno.EACCES, "Permission denied"), tmp_path) is None
    kept = tmp_path / "checkpoint_00000010"  # a complete checkpoint: the next one needs about as much
    kept.mkdir()
    (kept / "meta.json").write_text("{}")
    (kept / "model.safetensors").write_bytes(bytes(3 * 2**20))
    said = str(full_disk_in(OSError(errno.ENOSPC, "No space left"), tmp_path / "checkpoint_00000020" / "rng"))
    assert "MB free; a checkpoint takes about 3 MB)" in said, said
    assert fixable_line(RuntimeError("a bug")) is None


#: the toy job on 2 workers: 16 steps, a checkpoint every 4
TOY = ["scaling.num_workers=2", "data.global_batch_size=8", "loop.epochs=2", "checkpoint.every_steps=4",
       "logging.progress_bar=false"]  # fmt: skip


@contextlib.contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``folder`` (where the session's Ray workers and local processes
    see it too); the test skips where none can be mounted (root is needed)."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here (root is needed): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(path: Path) -> None:
    """Another program's file, written until the disk is full."""
    with contextlib.suppress(OSError), path.open("wb") as out:
        while True:
            out.write(bytes(2**20))
            out.flush()


def fill_after(marker: Path, filler: Path) -> threading.Thread:
    """A thread that fills the disk of ``filler`` once ``marker`` (the first checkpoint's record) is
    there, or once 600 s have passed (a guard against a hang only)."""

    def watch() -> None:
        deadline = time.monotonic() + 600
        while not marker.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        fill(filler)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_out_of_room(argv: list[str], runs: Path, capfd) -> tuple[int, str, int, str]:
    """``raytpu train`` (in this process) whose run folder fills after its first checkpoint, then the
    same command once the space is freed: both exit codes and what each printed."""
    filling = fill_after(runs / "toy" / "checkpoint_00000004" / "meta.json", runs / "filler")
    first = cli.main([*argv, "job.step_sleep=0.5"])
    filling.join()
    said = capfd.readouterr()
    (runs / "filler").unlink()
    second = cli.main(argv)
    return first, said.err, second, capfd.readouterr().out


def assert_one_line_then_resumed(first: int, err: str, second: int, out: str) -> None:
    """One console line (no traceback), exit 1; once the space is freed, resumed from the first
    checkpoint and completed."""
    assert first == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("raytpu: error:")]
    assert len(errors) == 1 and "no space left on its disk" in errors[0], err[-3000:]
    assert "Traceback" not in err and "[rank" not in err, err[-3000:]
    assert second == 0 and "resumed from" in out, out[-3000:]


def toy_config(tmp_path: Path) -> Path:
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\nrun: {{name: toy}}\n")
    return config


@pytest.mark.integration
def test_a_local_run_whose_disk_fills_says_one_line_and_resumes_once_there_is_room(tmp_path, capfd):
    """The toy job on 2 local processes (``--local``), its run folder on a 20 MB tmpfs that another
    program fills after the first checkpoint: the next checkpoint does not fit."""
    with tmpfs(tmp_path / "runs", "20m") as runs:
        argv = ["train", str(toy_config(tmp_path)), "--local", *TOY, f"run.storage_path={runs}"]
        assert_one_line_then_resumed(*run_out_of_room(argv, runs, capfd))


@pytest.mark.integration
def test_a_sharded_ray_run_whose_disk_fills_says_one_line_and_resumes_once_there_is_room(ray_session, tmp_path, capfd):
    """The toy job under FSDP2 on 2 Ray workers, its run folder on a 20 MB tmpfs that another
    program fills after the first checkpoint: the next checkpoint's DCP shards (or another record
    of the run) do not fit."""
    with tmpfs(tmp_path / "runs", "20m") as runs:
        argv = ["train", str(toy_config(tmp_path)), *TOY, "--fsdp", "full_shard", f"run.storage_path={runs}"]
        assert_one_line_then_resumed(*run_out_of_room(argv, runs, capfd))
