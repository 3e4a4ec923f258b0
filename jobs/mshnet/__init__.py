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

from raytpu.job import Batch, BatchDecoder, Columns, Job, JobConfig, StepContext
from raytpu.jobs.mshnet import metrics
from raytpu.jobs.mshnet.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    LISTS,
    IRSTDDataset,
    IRSTDTransform,
    decode_pair,
    read_names,
)
from raytpu.jobs.mshnet.loss import mshnet_loss
from raytpu.jobs.mshnet.model import MSHNet, init_fusion_as_level0


@dataclass(frozen=True)
class MSHNetConfig(JobConfig):
    """The ``job:`` section of an MSHNet config (defaults: the paper's IRSTD-1k settings)."""

    name: str = "mshnet"
    base_size: int = 256  # eval resize and the centre of the train rescale range
    crop_size: int = 256  # train crop
    warm_epoch: int = 5  # epochs 0..warm_epoch (warm_epoch + 1 of them) train the level-0 head; -1: no warm-up
    widths: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    blocks: int = 2  # attention residual blocks in each stage of levels 1-3, the middle and their decoders
    synth_n: int = 100  # images made by `raytpu data synth` / data.synthesize_if_missing
    synth_size: int = 256
    legacy_fa: bool = False  # count Fa as the authors' PD_FA does (see jobs/mshnet/metrics.py)
    # the fusion conv's initial weights: "random" (PyTorch's default, the authors'), or "level0":
    # the fused output starts equal to the level-0 head (see raytpu.jobs.mshnet.model.init_fusion_as_level0)
    fusion_init: str = "random"


class MSHNetJob(Job):
    """MSHNet on IRSTD-format data: SLS loss, mIoU/nIoU/Pd/Fa evaluation, the authors' flags.

    Warm-up as in the authors' ``main.py``: epoch ``e`` (counted from 0) trains
    the fused output with the SLS loss when ``e > warm_epoch``, else the level-0
    head alone with soft IoU. An evaluation after epoch ``e`` scores the output
    that epoch trained (level-0 head in warm-up, fused after); such warm-up
    evaluations are logged but never chosen as the best checkpoint. The test
    split always scores the fused output, as the authors' test mode does.
    """

    name = "mshnet"
    config_class = MSHNetConfig
    main_metric = "mIoU"
    main_metric_mode = "max"
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

    def check_config(self, cfg: Any) -> None:
        job = cfg.job
        if job.crop_size < 16 or job.base_size < 16 or job.crop_size % 16 or job.base_size % 16:
            raise ValueError(
                f"job.base_size ({job.base_size}) and job.crop_size ({job.crop_size}) must be positive multiples "
                "of 16 (four 2x poolings)"
            )
        if job.warm_epoch < -1:
            raise ValueError(f"job.warm_epoch must be at least -1 (no warm-up), got {job.warm_epoch}")
        if len(job.widths) != 5 or min(job.widths) < 1:
            raise ValueError(f"job.widths must be 5 positive channel counts, got {job.widths}")
        if job.blocks < 1:
            raise ValueError(f"job.blocks must be at least 1, got {job.blocks}")
        if job.fusion_init not in ("random", "level0"):
            raise ValueError(f"job.fusion_init must be 'random' or 'level0', got {job.fusion_init!r}")
        if job.synth_n < 2 or job.synth_size < 16:
            raise ValueError(
                f"job.synth_n must be at least 2 and job.synth_size at least 16 (got {job.synth_n}, {job.synth_size})"
            )

    def build_model(self, cfg: Any) -> nn.Module:
        model = MSHNet(3, cfg.job.widths, cfg.job.blocks)
        if cfg.job.fusion_init == "level0":
            init_fusion_as_level0(model)
        return model

    def build_dataset(self, cfg: Any, split: str, data_root: Path) -> Dataset:
        """``train``: trainval.txt with augmentation; ``valid`` and ``test``: test.txt resized to base_size."""
        if split not in ("train", "valid", "test"):
            raise ValueError(f"unknown split {split!r}; MSHNet has train, valid and test")
        source = "train" if split == "train" else "test"
        return IRSTDDataset(data_root, source, cfg.job.base_size, cfg.job.crop_size, cfg.run.seed)

    def synthesize(self, out: Path, n: int = 100, size: int = 128, seed: int = 0) -> None:
        from raytpu.jobs.mshnet.synth import synthesize  # scikit-image's filters: only when data is made

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

    @staticmethod
    def warm(cfg: Any, epoch: int) -> bool:
        """Whether epoch ``epoch`` (from 0) is past the warm-up: ``epoch > warm_epoch``, as the authors'."""
        return epoch > cfg.job.warm_epoch

    def eval_warm_flag(self, ctx: StepContext) -> bool:
        """The head an evaluation scores: the fused output on the test split and after
        warm-up, the level-0 head being trained during it (the authors' ``test(epoch)``)."""
        return ctx.split == "test" or self.warm(ctx.config, ctx.epoch)

    def warmup_epochs(self, cfg: Any) -> int:
        """Epochs 0..warm_epoch train the level-0 head alone (the side heads and the fusion conv get
        no gradient); their evaluations are logged, never the best checkpoint."""
        return cfg.job.warm_epoch + 1

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        """SLS loss; a Python flag picks the phase, so on XLA the switch is one extra graph."""
        warm = self.warm(ctx.config, ctx.epoch)
        side, logits = model(batch["image"], warm)
        loss = mshnet_loss(side, logits, batch["mask"], warm)
        return loss, {"loss": loss}

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        """Summable mIoU/nIoU/Pd/Fa counts (CPU float64 scalars) of the head :meth:`eval_warm_flag` picks."""
        _, logits = model(batch["image"], self.eval_warm_flag(ctx))
        return metrics.batch_stats(logits, batch["mask"], ctx.config.job.legacy_fa)

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        return metrics.finish(totals)

    def eval_images(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        """Grey input (first channel, de-normalised), label and sigmoid prediction, each (N, 1, H, W) in [0, 1]."""
        _, logits = model(batch["image"], self.eval_warm_flag(ctx))
        grey = batch["image"][:, :1].float() * float(IMAGENET_STD[0]) + float(IMAGENET_MEAN[0])
        return {"input": grey.clamp(0, 1), "label": batch["mask"].float(), "prediction": torch.sigmoid(logits.float())}


JOB = MSHNetJob()
