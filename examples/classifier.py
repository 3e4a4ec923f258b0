"""A whole raytpu job in one file: a small classifier of two interleaved half-moons."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.functional import cross_entropy

from raytpu.job import Job, JobConfig


@dataclass(frozen=True)
class ClassifierConfig(JobConfig):  # the `job:` section of a config file
    name: str = "examples.classifier"
    hidden: int = 32


class ClassifierJob(Job):
    name, config_class = "examples.classifier", ClassifierConfig
    main_metric, main_metric_mode = "accuracy", "max"  # what picks the best checkpoint

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(2, cfg.job.hidden), nn.ReLU(), nn.Linear(cfg.job.hidden, 2))

    def build_dataset(self, cfg, split, data_root):  # a map-style dataset of dicts of tensors
        x, y = torch.load(Path(data_root) / f"{split}.pt", weights_only=True)
        return [{"x": point, "y": label} for point, label in zip(x, y)]

    def train_step(self, model, batch, ctx):
        loss = cross_entropy(model(batch["x"]), batch["y"])
        return loss, {"loss": loss}

    def eval_step(self, model, batch, ctx):  # sums: the library adds them over batches and workers
        logits, y = model(batch["x"]), batch["y"]
        return {"correct": (logits.argmax(1) == y).sum().float(), "count": torch.ones_like(y).sum().float()}

    def finish_eval(self, totals):
        return {"accuracy": float(totals["correct"] / totals["count"])}

    def synthesize(self, out, n=1024, seed=0):  # optional: `raytpu data synth`, data.synthesize_if_missing
        generator = torch.Generator().manual_seed(seed)
        Path(out).mkdir(parents=True, exist_ok=True)
        for split, size in (("train", n), ("valid", n // 4), ("test", n // 4)):
            y, angle = torch.randint(0, 2, (size,), generator=generator), torch.rand(size, generator=generator)
            x = torch.stack([torch.cos(angle * math.pi) - y, torch.sin(angle * math.pi) * (1 - 2 * y) + y / 2], 1)
            torch.save((x + 0.1 * torch.randn(size, 2, generator=generator), y), Path(out) / f"{split}.pt")

    def synth_options(self, cfg):
        return {"seed": cfg.run.seed}


JOB = ClassifierJob()
