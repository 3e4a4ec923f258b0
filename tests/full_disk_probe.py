"""Fill a small filesystem the way a checkpoint does (torch.save, safetensors, a folder copied in,
a JSON record) and print, for each, what raytpu says of its failure (``tests/test_full_disk.py``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from raytpu.records.checkpoints import CheckpointWriteError

BIG = {"w": torch.zeros(4_000_000)}  # 16 MB: more than the filesystem holds


def main(full: Path, spare: Path) -> None:
    (spare / "staged").mkdir()
    (spare / "staged" / "weights.bin").write_bytes(bytes(3_000_000))
    writes = {
        "torch.save": lambda: torch.save(BIG, full / "train_state.pt"),
        "safetensors": lambda: save_file(BIG, str(full / "model.safetensors")),
        "copy": lambda: shutil.copytree(spare / "staged", full / "checkpoint_00000010"),
        "json": lambda: (full / "meta.json").write_text(json.dumps({"pad": "x" * 3_000_000})),
    }
    said = {}
    for name, write in writes.items():
        try:
            write()
            said[name] = "written"
        except Exception as exc:  # noqa: BLE001 - what each writer raises is what is looked at
            failure = CheckpointWriteError.of(exc, full)
            said[name] = str(failure) if failure else f"unrecognized {type(exc).__name__}: {exc}"
    print(json.dumps(said))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
