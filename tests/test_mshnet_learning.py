"""A smoke of MSHNet small's recipe through its warm-up switch, in-process on one worker: the
model trains on the level-0 head during warm-up, then on the fused output; the warm-up
evaluations are never the best; the best is one after the switch. Whether the recipe learns, on
five seeds beside an all-background prediction, is ``bench/learning.py``'s (``--jobs mshnet``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from raytpu.config import load_config
from raytpu.jobs.mshnet.synth import synthesize
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter

#: 40 images at 64x64 (32 train / 8 eval), global batch 8: 4 steps an epoch, 4 epochs, warm-up epochs 0-1
SHORT_RUN = [
    "scaling.num_workers=1",
    "loop.epochs=4",
    "job.warm_epoch=1",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.eval_images=0",
]


def test_the_small_recipe_trains_through_the_warmup_switch(tmp_path: Path) -> None:
    data = tmp_path / "mshnet"
    synthesize(data, n=40, size=64, seed=0)
    cfg, job = load_config("jobs/mshnet/small.yaml", [f"data.path={data}", *SHORT_RUN])
    torch.manual_seed(0)
    reporter = FolderReporter(tmp_path / "run")
    trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), tmp_path / "run", data, reporter)
    trainer.fit()
    evals = [(r["epoch"] - 1, r["valid/mIoU"], r["score"], r["train/loss"]) for r in reporter.reports]
    assert trainer.progress.step == 16 and len(evals) == 4, evals
    assert all(score == -1e30 for epoch, _, score, _ in evals if epoch <= cfg.job.warm_epoch), evals  # never best
    after = [e for e in evals if e[0] > cfg.job.warm_epoch]
    assert trainer.progress.best == max(e[1] for e in after), evals
    assert all(math.isfinite(loss) for *_, loss in evals), evals
