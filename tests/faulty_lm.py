"""The causal LM job with a fault injected at one training step, and each step's token blocks
recorded: for the tests of a failed Ray run and its resume (fault injection lives in test jobs,
never in raytpu's loop or config)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from raytpu.job import Batch, StepContext
from raytpu.jobs.causal_lm import CausalLMConfig, CausalLMJob


@dataclass(frozen=True)
class FaultyLMConfig(CausalLMConfig):
    name: str = "tests.faulty_lm"
    fail_at_step: int = 0  # a training step raises at this step (0 = never)
    seen_dir: str = ""  # each process appends its micro-batches' block hashes here (step, epoch, pid)


class FaultyLMJob(CausalLMJob):
    name = "tests.faulty_lm"
    config_class = FaultyLMConfig

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        job = ctx.config.job
        if ctx.step + 1 == job.fail_at_step and not (job.seen_dir and Path(job.seen_dir, "failed").exists()):
            if job.seen_dir:  # a run that records its steps fails once: Ray's restart goes past the step
                Path(job.seen_dir, "failed").touch()
            raise RuntimeError(f"fault injected by job.fail_at_step={job.fail_at_step}")
        if ctx.config.job.seen_dir:
            from tests.corpus_files import row_hash

            rows = [row_hash(row) for row in batch["input_ids"].cpu().numpy()]
            seen = {"pid": os.getpid(), "step": ctx.step + 1, "epoch": ctx.epoch, "rows": rows}
            with open(Path(ctx.config.job.seen_dir, f"{os.getpid()}.jsonl"), "a") as out:
                out.write(json.dumps(seen) + "\n")
        return super().train_step(model, batch, ctx)


JOB = FaultyLMJob()
