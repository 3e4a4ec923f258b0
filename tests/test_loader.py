"""The torch input pipeline: DataLoader worker processes that live the whole run (across epochs
and evaluations), each moved to the epoch itself, and a mid-epoch resume that reads the same
samples in the same order."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from raytpu.config import load_config
from raytpu.runtime import make_runtime
from raytpu.worker.data import TorchData
from tests.toy_job import ToyJob

CONFIG = ["job.name=tests.toy_job", "data.global_batch_size=4", "data.num_workers=2", "job.samples=16"]


class Traced(Dataset):
    """Each item says which process read it, at which epoch."""

    def __init__(self, samples: int) -> None:
        self.samples, self.epoch = samples, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index), "pid": torch.tensor(os.getpid()), "epoch": torch.tensor(self.epoch)}


class TracedJob(ToyJob):
    def build_dataset(self, cfg: Any, split: str, data_root: Path) -> Dataset:
        return Traced(16 if split == "train" else 8)


def read(batches) -> dict[str, list[int]]:
    items = list(batches)
    return {key: torch.cat([batch[key] for batch in items]).tolist() for key in ("index", "pid", "epoch")}


def torch_data() -> TorchData:
    cfg, _ = load_config(None, CONFIG)
    return TorchData(cfg, TracedJob(), make_runtime("cpu", "fp32", 1, 0, 0), Path("."))


def test_loader_workers_outlive_epochs_and_evaluations():
    data = torch_data()
    first = read(data.epoch(0))
    valid = read(data.eval_batches("valid"))
    second = read(data.epoch(1))
    again = read(data.eval_batches("valid"))
    workers = set(first["pid"])
    assert len(workers) == 2 and os.getpid() not in workers
    assert set(second["pid"]) == workers  # the same two processes, not new ones
    assert set(again["pid"]) == set(valid["pid"]) and len(set(valid["pid"])) == 2
    assert set(first["epoch"]) == {0} and set(second["epoch"]) == {1}  # each worker moved to the epoch
    assert sorted(first["index"]) == sorted(second["index"]) == list(range(16))
    assert first["index"] != second["index"]  # reshuffled per epoch


def test_a_mid_epoch_resume_reads_the_rest_of_the_epoch_in_order():
    straight = read(torch_data().epoch(3))
    resumed = read(torch_data().epoch(3, skip=2))  # two batches of 4 already trained
    assert resumed["index"] == straight["index"][8:] and set(resumed["epoch"]) == {3}
