"""When a run evaluates and checkpoints, and what each of its reports says.

:class:`Cadence` is the one place that decides when to evaluate and when to checkpoint;
:class:`Scoreboard` turns an evaluation into a report: the metrics, where the run is, the
checkpoint's score (what Ray Train keeps the best checkpoints by) and the best so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raytpu.config import Config
from raytpu.job import Job, in_warmup
from raytpu.runtime.base import Runtime
from raytpu.worker.state import Progress

#: why a checkpoint was taken, saved in its ``meta.json``: on the schedule, because the driver
#: was asked to stop (a signal), or because Ray announced that a node of the run is being preempted
REASONS = ("scheduled", "stop", "preempted")


@dataclass(frozen=True)
class Cadence:
    """When to evaluate and when to checkpoint: the one place that decides.

    Checkpoints: every ``checkpoint.every_steps`` steps, else at every epoch end. Evaluations:
    every ``loop.eval_every_steps`` steps when set (TrainingArguments' ``eval_steps``), else with
    each ``every_steps`` checkpoint, else every ``loop.eval_every_epochs`` epoch ends. A checkpoint
    taken without an evaluation carries no score and is never the best, so with both step counts
    set, ``every_steps`` should be a multiple of ``eval_every_steps`` (Transformers asks the same of
    ``save_steps`` for ``load_best_model_at_end``). The last step always evaluates and checkpoints.
    """

    total_steps: int
    every_steps: int
    eval_every_epochs: int
    eval_every_steps: int = 0

    def decide(self, step: int, epoch_ended: bool, epochs_done: int) -> tuple[bool, bool]:
        """``(evaluate, checkpoint)`` after ``step``."""
        if step >= self.total_steps:
            return True, True
        checkpoint = step % self.every_steps == 0 if self.every_steps else epoch_ended
        if self.eval_every_steps:
            return step % self.eval_every_steps == 0, checkpoint
        if self.every_steps:
            return checkpoint, checkpoint
        return checkpoint and epochs_done % self.eval_every_epochs == 0, checkpoint


class Scoreboard:
    """The values of each report, and the mean training loss between reports."""

    def __init__(self, cfg: Config, job: Job, runtime: Runtime) -> None:
        self.cfg, self.job, self.runtime = cfg, job, runtime
        # finite: Ray's checkpoint snapshot is JSON, where an infinity comes back as null
        self.worst = -1e30 if job.main_metric_mode == "max" else 1e30
        self.reset_loss()

    def reset_loss(self) -> None:
        self.loss_sum = torch.zeros((), device=self.runtime.device)
        self.loss_steps = 0

    def add_loss(self, loss: torch.Tensor) -> None:
        """A step's mean loss, kept on the device (read only at the next report)."""
        self.loss_sum = self.loss_sum + loss
        self.loss_steps += 1

    def train_loss(self) -> dict[str, float]:
        """``train/loss``: the mean training loss over the steps since the last report, over all
        workers (a metric Tune can use as well as the validation ones)."""
        steps = self.loss_steps
        total = self.runtime.all_reduce_sum({"loss": self.loss_sum})["loss"]
        self.reset_loss()
        return {"train/loss": float(total) / (steps * self.runtime.data_parallel_size)} if steps else {}

    def counts_for_best(self, metrics: dict[str, float], weights_epoch: int) -> bool:
        """An eval of the main metric, of weights past the job's warm-up: it competes for the best checkpoint."""
        has_score = f"valid/{self.job.main_metric}" in metrics
        return has_score and not in_warmup(self.job, self.cfg, weights_epoch)

    def update_best(self, progress: Progress, metrics: dict[str, float]) -> None:
        value, best = metrics[f"valid/{self.job.main_metric}"], progress.best
        if best is None or (value > best if self.job.main_metric_mode == "max" else value < best):
            progress.best = value

    def values(self, progress: Progress, metrics: dict[str, float], scored: bool) -> dict[str, Any]:
        """What one report carries: the metrics, where the run is, and the scores. ``score`` is
        the eval's main metric, or the worst value when the report has no eval that counts."""
        main = metrics.get(f"valid/{self.job.main_metric}")
        return {
            **metrics,
            "step": progress.step,
            "epoch": progress.epoch,
            "report": progress.reports,
            "score": main if scored and main is not None else self.worst,
            "best": progress.best if progress.best is not None else self.worst,
        }
