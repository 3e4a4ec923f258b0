"""The causal LM job with a fault injected at one training step: for the tests of a failed Ray run
and its resume (fault injection lives in test jobs, never in raytpu's loop or config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from raytpu.job import Batch, StepContext
from raytpu.jobs.causal_lm import CausalLMConfig, CausalLMJob


@dataclass(frozen=True)
class FaultyLMConfig(CausalLMConfig):
    name: str = "tests.faulty_lm"
    fail_at_step: int = 0  # a training step raises at this step (0 = never)


class FaultyLMJob(CausalLMJob):
    name = "tests.faulty_lm"
    config_class = FaultyLMConfig

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        if ctx.step + 1 == ctx.config.job.fail_at_step:
            raise RuntimeError(f"fault injected by job.fail_at_step={ctx.config.job.fail_at_step}")
        return super().train_step(model, batch, ctx)


JOB = FaultyLMJob()
