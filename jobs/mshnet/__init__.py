"""MSHNet (CVPR 2024, infrared small-target segmentation) as a raytpu job."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from jobs.mshnet import metrics
from jobs.mshnet.data import IMAGENET_MEAN, IMAGENET_STD, IRSTDDataset
from jobs.mshnet.loss import mshnet_loss
from jobs.mshnet.model import MSHNet
from jobs.mshnet.synth import synthesize
from raytpu.job import Batch, Job, JobConfig, StepContext


@dataclass
class MSHNetConfig(JobConfig):
    name: str = "mshnet"
    base_size: int = 256
    crop_size: int = 256
    warm_epoch: int = 5  # epochs trained with the level-0 head and plain soft-IoU loss
    widths: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    synth_n: int = 100
    synth_size: int = 256


class MSHNetJob(Job):
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
        train = split == "train"
        return IRSTDDataset(
            data_root, "train" if train else "test", cfg.job.base_size, cfg.job.crop_size, cfg.run.seed, augment=train
        )

    def synthesize(self, out: Path, n: int = 100, size: int = 128, seed: int = 0) -> None:
        synthesize(out, n=n, size=size, seed=seed)

    def synth_options(self, cfg: Any) -> dict[str, Any]:
        return {"n": cfg.job.synth_n, "size": cfg.job.synth_size, "seed": cfg.run.seed}

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        warm = ctx.epoch >= ctx.config.job.warm_epoch
        side, logits = model(batch["image"], warm)
        loss = mshnet_loss(side, logits, batch["mask"], warm)
        return loss, {"loss": loss}

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        _, logits = model(batch["image"], True)
        return metrics.batch_stats(logits, batch["mask"])

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        return metrics.finish(totals)

    def eval_images(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        _, logits = model(batch["image"], True)
        mean = torch.as_tensor(IMAGENET_MEAN, device=logits.device).view(1, 3, 1, 1)
        std = torch.as_tensor(IMAGENET_STD, device=logits.device).view(1, 3, 1, 1)
        image = (batch["image"] * std + mean).clamp(0, 1)
        return {"input": image, "label": batch["mask"], "prediction": torch.sigmoid(logits.float())}


JOB = MSHNetJob()
