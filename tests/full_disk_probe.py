"""Fill a small filesystem the way a run does (torch.save, safetensors, a sharded checkpoint's DCP
files, a folder copied in, a JSON record, TensorBoard events) and print, for each, what raytpu says
of its failure (``tests/test_full_disk.py``)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from raytpu.records.checkpoints import CheckpointWriteError
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.logger import RunLogger
from raytpu.worker.state import TrainState, save_shards

BIG = {"w": torch.zeros(4_000_000)}  # 16 MB: more than the filesystem holds


def main(full: Path, spare: Path) -> None:
    (spare / "staged").mkdir()
    (spare / "staged" / "weights.bin").write_bytes(bytes(3_000_000))
    writes = {
        "torch.save": lambda: torch.save(BIG, full / "train_state.pt"),
        "safetensors": lambda: save_file(BIG, str(full / "model.safetensors")),
        "copy": lambda: shutil.copytree(spare / "staged", full / "checkpoint_00000010"),
        "json": lambda: (full / "meta.json").write_text(json.dumps({"pad": "x" * 3_000_000})),
        "dcp": lambda: save_shards(full / "sharded", big_train_state()),
        "tensorboard": lambda: log_until_full(full),
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


def big_train_state() -> TrainState:
    model = torch.nn.Linear(2_000, 2_000)  # 16 MB of weights
    return TrainState(model, None, torch.optim.SGD(model.parameters(), lr=0.1), None)


def log_until_full(full: Path) -> None:
    """Text events (each flushed) into the run folder's TensorBoard log until one does not fit."""
    logger = RunLogger(RunFolder(str(full)), enabled=True, tensorboard=True, progress_bar=False, total=1, initial=0)
    for step in range(10_000):
        logger.texts({"sample": "x" * 100_000}, step)
        logger.flush()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
