"""A tiny regression job used to test the loop quickly; also shows that a job
outside ``jobs/`` plugs in by its dotted module path."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from raytpu.job import Batch, BatchDecoder, Columns, Job, JobConfig, StepContext


@dataclass(frozen=True)
class ToyConfig(JobConfig):
    name: str = "tests.toy_job"
    samples: int = 64
    features: int = 8
    noise: float = 0.1
    dropout: float = 0.1
    vary_shape: bool = False  # a new batch shape every step: forces XLA recompiles (guard test)
    step_sleep: float = 0.0  # seconds each training step waits: slow enough to be interrupted
    pid_dir: str = ""  # each training process writes an empty file named by its pid here
    # at its first step a process waits (at most 300 s) until this many have written theirs: the
    # trials of a sweep then train side by side, however far apart a busy machine starts them
    wait_for_pids: int = 0
    oom_above: int = -1  # raise an out-of-memory error on a micro-batch of more samples than this (-1: never)
    oom_kind: str = "xla"  # which error: xla (a device buffer), xla_compile (the program), cuda
    oom_rank: int = -1  # only this rank runs out of memory (-1: every rank)
    fail_at_step: int = 0  # fault injection: a training step raises at this step (0 = never)
    constant_metric: float = -1.0  # evaluations report this mse (>= 0): a tie between checkpoints
    item_sleep: float = 0.0  # seconds each sample takes to load (the loop waits for input)
    checkpoint_sleep: float = 0.0  # seconds the model's state_dict takes (a slow checkpoint write)
    seen_dir: str = ""  # each training process appends its micro-batches' sample indices here (step, epoch)


#: the out-of-memory errors a toy step raises, as each runtime raises them
OUT_OF_MEMORY: dict[str, tuple[type[Exception], str]] = {
    "xla": (
        RuntimeError,
        "Bad StatusOr access: RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 1.00G. "
        "That was not possible. There are 500.00M free.; (0x0x0_HBM0)",
    ),
    "xla_compile": (
        ValueError,
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
        "Used 20.50G of 15.48G hbm. Exceeded hbm capacity by 5.02G.\n\nTotal hbm usage >= 21.02G:\n"
        "    reserved        530.00M\n    program          20.50G\n",
    ),
    "cuda": (
        torch.OutOfMemoryError,
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "1.02 GiB is free.",
    ),
}


class SlowStateSequential(nn.Sequential):
    """The toy model, whose ``state_dict`` (a checkpoint's first step) takes ``pause`` seconds."""

    def __init__(self, *layers: nn.Module, pause: float = 0.0) -> None:
        super().__init__(*layers)
        self.pause = pause

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.pause)
        return super().state_dict(*args, **kwargs)


class ToyData(Dataset):
    def __init__(self, samples: int, features: int, noise: float, seed: int, pause: float = 0.0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(samples, features, generator=generator)
        weight = torch.arange(1, features + 1, dtype=torch.float32) / features
        self.y = self.x @ weight + noise * torch.randn(samples, generator=generator)
        self.epoch, self.pause = 0, pause

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(self.pause)
        return {"x": self.x[index], "y": self.y[index : index + 1], "index": torch.tensor(index)}


class ToyJob(Job):
    name = "tests.toy_job"
    config_class = ToyConfig
    main_metric = "mse"
    main_metric_mode = "min"
    aliases = {"--batch-size": "data.global_batch_size"}

    def build_model(self, cfg: Any) -> nn.Module:
        layers = (nn.Linear(cfg.job.features, 16), nn.Tanh(), nn.Dropout(cfg.job.dropout), nn.Linear(16, 1))
        return SlowStateSequential(*layers, pause=cfg.job.checkpoint_sleep)

    def build_dataset(self, cfg: Any, split: str, data_root: Path) -> Dataset:
        seed = {"train": 0, "valid": 1, "test": 2}[split]
        samples = cfg.job.samples if split == "train" else 16
        return ToyData(samples, cfg.job.features, cfg.job.noise, seed, cfg.job.item_sleep)

    def synthesize(self, out: Path, **options: Any) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "READY").write_text("toy data is generated in memory\n")
        (out / "toy.json").write_text(json.dumps(options))  # what `raytpu data prepare` writes out

    def synth_options(self, cfg: Any) -> dict[str, Any]:
        return {}

    # the Ray Data seam: the in-memory samples as tables, `index` = `id`
    def table_names(self, src: Path) -> list[str]:
        return ["train", "valid", "test"]

    def table_records(self, src: Path, table: str, rows: int) -> Iterator[Columns]:
        options = {**vars(ToyConfig()), **json.loads((Path(src) / "toy.json").read_text())}
        data = self.build_dataset(type("Cfg", (), {"job": ToyConfig(**options)}), table, src)
        for start in range(0, len(data), rows):
            index = np.arange(start, min(start + rows, len(data)))
            yield {"id": index, "x": data.x[index].numpy(), "y": data.y[index].numpy()}

    def batch_decoder(self, cfg: Any, split: str, stats_root: Path) -> BatchDecoder:
        def decode(columns: Columns, epoch: int) -> Batch:
            x, y = torch.from_numpy(columns["x"]), torch.from_numpy(columns["y"])
            return {"x": x, "y": y[:, None], "index": torch.from_numpy(columns["id"])}

        return decode

    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        if ctx.step + 1 == ctx.config.job.fail_at_step:
            raise RuntimeError(f"fault injected by job.fail_at_step={ctx.config.job.fail_at_step}")
        if ctx.config.job.pid_dir:
            Path(ctx.config.job.pid_dir, str(os.getpid())).touch()
            deadline = time.monotonic() + 300
            job = ctx.config.job
            while len(os.listdir(job.pid_dir)) < job.wait_for_pids and time.monotonic() < deadline:
                time.sleep(0.2)
        if ctx.config.job.seen_dir:
            seen = {"pid": os.getpid(), "attempt": ATTEMPT, "time": time.time(), "step": ctx.step + 1,
                    "epoch": ctx.epoch, "index": batch["index"].tolist()}  # fmt: skip
            with open(Path(ctx.config.job.seen_dir, f"{os.getpid()}.jsonl"), "a") as out:
                out.write(json.dumps(seen) + "\n")
        time.sleep(ctx.config.job.step_sleep)
        x, y = batch["x"], batch["y"]
        self.maybe_out_of_memory(ctx.config.job, len(x))
        if ctx.config.job.vary_shape:
            keep = 1 + ctx.step % len(x)
            x, y = x[:keep], y[:keep]
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {"loss": loss}

    @staticmethod
    def maybe_out_of_memory(cfg: ToyConfig, batch: int) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if 0 <= cfg.oom_above < batch and cfg.oom_rank in (-1, rank):
            error, text = OUT_OF_MEMORY[cfg.oom_kind]
            raise error(text)

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        error = (model(batch["x"]) - batch["y"]).pow(2).sum()
        if ctx.config.job.constant_metric >= 0:  # every evaluation ties
            error = torch.tensor(ctx.config.job.constant_metric * len(batch["x"]))
        return {"sse": error, "count": torch.tensor(float(len(batch["x"])))}

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"mse": float(totals["sse"] / totals["count"])}


#: this process's attempt (a group's life): its world size and start, the same on every rank
ATTEMPT = f"{os.environ.get('WORLD_SIZE', '1')}-{os.environ.get('MASTER_PORT', '')}"

JOB = ToyJob()
