"""A smoke of CDEIT small's recipe in-process on one worker: a short run whose validation loss
falls, then test mode on the simulated test images (the 5-step DDIM-EIT sampler, and one step:
the posterior mean). Whether the recipe learns, on several seeds beside the all-zeros and
Tikhonov baselines, is ``bench/learning.py``'s (``--jobs cdeit``)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from raytpu.config import load_config, with_values
from raytpu.jobs.cdeit.synth import synthesize
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter

#: the small recipe's model on 128 samples, 2 epochs of 8 steps (its global batch of 16), evaluated at each end
SHORT_RUN = [
    "scaling.num_workers=1",
    "loop.epochs=2",
    "optim.lr=1e-3",
    "optim.warmup_steps=4",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.eval_images=0",
]


def test_a_short_run_of_the_small_recipe_lowers_its_validation_loss_and_samples(tmp_path: Path) -> None:
    data = tmp_path / "cdeit"
    synthesize(data, n_train=128, n_valid=16, n_test=8, size=32, seed=0)
    cfg, job = load_config("jobs/cdeit/small.yaml", [f"data.path={data}", *SHORT_RUN])
    torch.manual_seed(cfg.run.seed)
    reporter = FolderReporter(tmp_path / "run")
    trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), tmp_path / "run", data, reporter)
    trainer.fit()
    losses = [report["valid/val_loss"] for report in reporter.reports]
    assert trainer.progress.step == 16 and len(losses) == 2, losses
    assert losses[-1] < losses[0], losses
    for steps in (5, 1):  # the sampler, then the posterior mean
        metrics = job.test(trainer.eval_model(), with_values(cfg, {"job.sampling_steps": steps}), tmp_path, data)
        assert math.isfinite(metrics["rmse"]) and metrics["rmse"] > 0, metrics
