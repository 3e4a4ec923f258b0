"""MSHNet (CVPR 2024, infrared small-target segmentation) as a raytpu job."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from jobs.mshnet import metrics
from jobs.mshnet.data import IMAGENET_MEAN, IMAGENET_STD, LISTS, IRSTDDataset, IRSTDTransform, decode_pair, read_names
from jobs.mshnet.loss import mshnet_loss
from jobs.mshnet.model import MSHNet
from jobs.mshnet.synth import synthesize
from raytpu.job import Batch, BatchDecoder, Columns, Job, JobConfig, StepContext


@dataclass
class MSHNetConfig(JobConfig):
    """The ``job:`` section of an MSHNet config (defaults: the paper's IRSTD-1k settings)."""

    name: str = "mshnet"
    base_size: int = 256  # eval resize and the centre of the train rescale range
    crop_size: int = 256  # train crop
    warm_epoch: int = 5  # epochs trained with the level-0 head and plain soft-IoU loss
    widths: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    synth_n: int = 100  # images made by `raytpu data synth` / data.synthesize_if_missing
    synth_size: int = 256
    legacy_fa: bool = False  # count Fa as the authors' PD_FA does (see jobs/mshnet/metrics.py)


class MSHNetJob(Job):
    """MSHNet on IRSTD-format data: SLS loss, mIoU/nIoU/Pd/Fa evaluation, the authors' flags.

    Evaluation always uses the fused output (``warm_flag=True``), as the
    authors' test mode does; during warm-up that output is still untrained, so
    the epochs' eval numbers only mean something from ``warm_epoch`` on.
    """

    name = "mshnet"
    config_class = MSHNetConfig
    main_metric = "mIoU"
    main_metric_mode = "max"
    find_unused_parameters = True  # warm-up skips the side heads and the fusion conv
    aliases = {
        "--dataset-dir": "data.path",
        "--batch-size": "data.global_batch_size",
        "--epochs": "loop.epochs",
        "--lr": "optim.lr",
        "--warm-epoch": "job.warm_epoch",
        "--base-size": "job.base_size",
        "--crop-size": "job.crop_size",
        "--mode": "run.mode",
        "--weight-path": "checkpoint.weights",
    }

    def build_model(self, cfg: Any) -> nn.Module:
        if cfg.job.crop_size % 16 or cfg.job.base_size % 16:
            raise ValueError("job.base_size and job.crop_size must be multiples of 16 (four 2x poolings)")
        return MSHNet(3, cfg.job.widths)

    def build_dataset(self, cfg: Any, split: str, data_root: Path) -> Dataset:
        """``train``: trainval.txt with augmentation; ``valid`` and ``test``: test.txt resized to base_size."""
        if split not in ("train", "valid", "test"):
            raise ValueError(f"unknown split {split!r}; MSHNet has train, valid and test")
        source = "train" if split == "train" else "test"
        return IRSTDDataset(data_root, source, cfg.job.base_size, cfg.job.crop_size, cfg.run.seed)

    def synthesize(self, out: Path, n: int = 100, size: int = 128, seed: int = 0) -> None:
        synthesize(out, n=n, size=size, seed=seed)

    def synth_options(self, cfg: Any) -> dict[str, Any]:
        return {"n": cfg.job.synth_n, "size": cfg.job.synth_size, "seed": cfg.run.seed}

    # ---------------------------------------------------- tables (data.loader=ray)
    def table_names(self, src: Path) -> list[str]:
        """``train`` (trainval.txt) and ``test`` (test.txt): the PNG files' bytes, unchanged."""
        return [table for table, listing in LISTS.items() if (Path(src) / listing).is_file()]

    def table_for_split(self, cfg: Any, split: str) -> str:
        if split not in ("train", "valid", "test"):
            raise ValueError(f"unknown split {split!r}; MSHNet has train, valid and test")
        return "train" if split == "train" else "test"

    def table_records(self, src: Path, table: str, rows: int) -> Iterator[Columns]:
        names = read_names(Path(src), table)
        for start in range(0, len(names), rows):
            chunk = names[start : start + rows]
            yield {
                "id": np.arange(start, start + len(chunk), dtype=np.int64),
                "name": chunk,
                "image": [(Path(src) / "images" / f"{name}.png").read_bytes() for name in chunk],
                "mask": [(Path(src) / "masks" / f"{name}.png").read_bytes() for name in chunk],
            }

    def batch_decoder(self, cfg: Any, split: str, stats_root: Path) -> BatchDecoder:
        """PNG bytes -> the same augmented (train) or resized (valid/test) tensors as :class:`IRSTDDataset`."""
        job, augment = cfg.job, self.table_for_split(cfg, split) == "train"

        def decode(columns: Columns, epoch: int) -> Batch:
            transform = IRSTDTransform(job.base_size, job.crop_size, cfg.run.seed, augment)  # per call: thread-safe
            transform.set_epoch(epoch)
            pairs = zip(columns["id"], columns["image"], columns["mask"])
            items = [transform.item(*decode_pair(image, mask), int(index)) for index, image, mask in pairs]
            return {key: torch.stack([item[key] for item in items]) for key in items[0]}

        return decode

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        """SLS loss; a Python flag picks the phase, so on XLA the switch is one extra graph."""
        warm = ctx.epoch >= ctx.config.job.warm_epoch
        side, logits = model(batch["image"], warm)
        loss = mshnet_loss(side, logits, batch["mask"], warm)
        return loss, {"loss": loss}

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        """Summable mIoU/nIoU/Pd/Fa counts of the fused output (CPU float64 scalars)."""
        _, logits = model(batch["image"], True)
        return metrics.batch_stats(logits, batch["mask"], ctx.config.job.legacy_fa)

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        return metrics.finish(totals)

    def eval_images(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Grey input (first channel, de-normalised), label and sigmoid prediction, each (N, 1, H, W) in [0, 1]."""
        _, logits = model(batch["image"], True)
        grey = batch["image"][:, :1].float() * float(IMAGENET_STD[0]) + float(IMAGENET_MEAN[0])
        return {"input": grey.clamp(0, 1), "label": batch["mask"].float(), "prediction": torch.sigmoid(logits.float())}


JOB = MSHNetJob()
