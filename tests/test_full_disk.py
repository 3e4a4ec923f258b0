"""A full disk, for real: a 2 MB tmpfs mounted in a private mount namespace (``unshare -m``, as
root), filled by each way a checkpoint writes (torch.save's C++ writer, safetensors, a staged
folder copied in, a JSON record). Each failure reads as one line naming the folder and the space
left, never as the writer's own message (``unexpected pos 576 vs 534``, a list of errno tuples)."""

from __future__ import annotations

import json
import subprocess
import sys

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
    assert set(said) == {"torch.save", "safetensors", "copy", "json"}
    for writer, line in said.items():
        assert line.startswith("cannot write the checkpoint at "), (writer, line)
        assert "no space left on its disk (0 MB free)" in line, (writer, line)
        assert "\n" not in line and "Errno" not in line and "unexpected pos" not in line, (writer, line)
        assert "rerun the same command" in line
