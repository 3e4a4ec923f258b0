"""A full disk, for real: a 2 MB tmpfs mounted in a private mount namespace (``unshare -m``, as
root), filled by each way a run writes (torch.save's C++ writer, safetensors, DCP shards, a staged
folder copied in, a JSON record, TensorBoard events). Each failure reads as one line naming the folder and the space
left, never as the writer's own message (``unexpected pos 576 vs 534``, a list of errno tuples)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


RUN = (
    'mount -t tmpfs -o size=40m tmpfs "$1" && "$2" -m raytpu.cli train --local jobs/mshnet/small.yaml '
    'checkpoint.every_steps=10 loop.max_steps=30 logging.progress_bar=false run.storage_path="$1" data.path="$3" '
    '2>"$1.first"; echo "first=$?"; mount -o remount,size=400m "$1" && "$2" -m raytpu.cli train --local '
    "jobs/mshnet/small.yaml checkpoint.every_steps=10 loop.max_steps=30 logging.progress_bar=false "
    'run.storage_path="$1" data.path="$3"; echo "second=$?"'
)


@pytest.mark.integration
def test_a_local_run_whose_disk_fills_says_one_line_and_resumes_once_there_is_room(tmp_path):
    """MSHNet small on 2 local processes, its run folder on a 40 MB tmpfs: the first checkpoint fits,
    the second does not. The console says it in one line (no traceback), exit 1; the first
    checkpoint is whole, and the same command resumes from it once the filesystem has room."""
    runs, data = tmp_path / "runs", tmp_path / "data"
    runs.mkdir()
    command = ["unshare", "-m", "sh", "-c", RUN, "sh", str(runs), sys.executable, str(data)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if "first=" not in done.stdout:
        pytest.skip(f"no private mount namespace with a tmpfs here (root is needed): {done.stderr.strip()}")
    first = (tmp_path / "runs.first").read_text()
    assert "first=1" in done.stdout, done.stdout[-3000:] + first
    said = [line for line in first.splitlines() if line.strip()]
    errors = [line for line in said if line.startswith("raytpu: error:")]
    assert len(errors) == 1 and "no space left on its disk" in errors[0], first
    assert "Traceback" not in first and "[rank" not in first, first
    assert "resumed from" in done.stdout and "second=0" in done.stdout, done.stdout[-3000:]


#: the toy job under FSDP2 on 2 workers: 16 steps, a checkpoint every 4
SHARDED_TOY = ["--fsdp", "full_shard", "scaling.num_workers=2", "data.global_batch_size=8", "loop.epochs=2",
               "checkpoint.every_steps=4", "logging.progress_bar=false"]  # fmt: skip


def fill(path: Path) -> None:
    """Another program's file, written until the disk is full."""
    with contextlib.suppress(OSError), path.open("wb") as out:
        while True:
            out.write(bytes(2**20))
            out.flush()


@pytest.mark.integration
def test_a_sharded_ray_run_whose_disk_fills_says_one_line_and_resumes_once_there_is_room(ray_session, tmp_path):
    """The toy job under FSDP2 on 2 Ray workers, its run folder on a 20 MB tmpfs that another
    program fills after the first checkpoint: the next checkpoint's DCP shards (or another record
    of the run) do not fit. The console says it in one line (no traceback), exit 1; once the space
    is freed, the same command resumes from the first checkpoint and completes."""
    runs = tmp_path / "runs"
    runs.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(runs)]  # seen by the session's Ray workers
    mounted = subprocess.run(mount, capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs can be mounted here (root is needed): {mounted.stderr.strip()}")
    try:
        config = tmp_path / "toy.yaml"
        config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path}}}\nrun: {{name: toy}}\n")
        address = ray_session.get_runtime_context().gcs_address
        command = [sys.executable, "-m", "raytpu.cli", "train", str(config), *SHARDED_TOY, f"run.storage_path={runs}"]
        command += ["--address", address]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        first = subprocess.Popen([*command, "job.step_sleep=0.5"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        checkpointed = runs / "toy" / "checkpoint_00000004" / "meta.json"
        deadline = time.monotonic() + 600  # a guard against a hang only
        while not checkpointed.is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        fill(runs / "filler")
        out, err = first.communicate(timeout=600)
        (runs / "filler").unlink()
        second = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        subprocess.run(["umount", "-l", str(runs)], capture_output=True)
    assert first.returncode == 1, out[-3000:] + err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("raytpu: error:")]
    assert len(errors) == 1 and "no space left on its disk" in errors[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stdout[-3000:] + second.stderr[-3000:]
