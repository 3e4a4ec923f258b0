"""The training loop: written once, for every job and every runtime.

:class:`Trainer` runs inside one Ray Train worker (or in-process, for tests
and benchmarks, with a :class:`LocalReporter`). Per step it does exactly one
device sync; everything it logs is read in a step closure, after the step's
graph ran, so nothing in the step waits on the host.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from raytpu import checkpoint as ckpt
from raytpu.config import Config, per_worker_batch, to_dict
from raytpu.job import Job, StepContext
from raytpu.logger import RunLogger, watch_grad_norm
from raytpu.optim import EMA, build_optimizer, build_scheduler
from raytpu.runtime import Runtime


class NonFiniteLossError(RuntimeError):
    pass


class RecompileError(RuntimeError):
    pass


class Reporter:
    """Where checkpoints and metrics go: Ray Train, or a local folder."""

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str) -> None:
        raise NotImplementedError

    def latest_checkpoint(self) -> Path | None:
        raise NotImplementedError


class RayReporter(Reporter):
    def __init__(self) -> None:
        self._restore = None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str) -> None:
        import ray.train

        checkpoint = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)

    def latest_checkpoint(self) -> Path | None:
        import ray.train

        found = ray.train.get_checkpoint()
        if found is None:
            return None
        self._restore = found.as_directory()
        return Path(self._restore.__enter__())


class LocalReporter(Reporter):
    """Keeps checkpoints under ``<run_dir>/checkpoints`` (in-process runs)."""

    def __init__(self, run_dir: Path, num_to_keep: int = 2) -> None:
        self.root = run_dir / "checkpoints"
        self.num_to_keep = num_to_keep
        self.reports: list[dict[str, Any]] = []

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None, name: str) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is None:
            return
        target = self.root / name
        staging = self.root / f".{name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(checkpoint_dir, staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        for old in self._complete()[: -self.num_to_keep]:
            shutil.rmtree(old)

    def _complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if not p.name.startswith(".") and ckpt.is_complete(p))

    def latest_checkpoint(self) -> Path | None:
        found = self._complete()
        return found[-1] if found else None


@dataclass
class Progress:
    step: int = 0
    epoch: int = 0
    best: float | None = None
    #: reports (eval rounds with a checkpoint) so far, counted across resumes: Tune's time unit
    reports: int = 0


class Trainer:
    def __init__(
        self,
        cfg: Config,
        job: Job,
        runtime: Runtime,
        run_dir: Path,
        data_root: Path,
        reporter: Reporter,
        datasets: dict[str, Any] | None = None,
    ) -> None:
        """``datasets``: split -> Ray ``DataIterator``, read when ``data.loader`` is ``ray``."""
        self.cfg, self.job, self.runtime = cfg, job, runtime
        self.run_dir, self.data_root, self.reporter = run_dir, data_root, reporter
        self.datasets = datasets or {}
        self.ray_data: Any = None  # raytpu.ingest.RayData when data.loader=ray
        self.progress = Progress()
        self.rank = runtime.rank
        self._stop_reason: str | None = None
        self._last_log = (time.perf_counter(), 0)
        self.recompiles = 0
        self.logger: RunLogger | None = None  # set by fit(); test mode has none

    # ------------------------------------------------------------ build
    def _seed(self) -> None:
        seed = self.cfg.run.seed * 1000 + self.rank
        random.seed(seed)
        np.random.seed(seed)
        self.runtime.seed(seed)

    def _worker_batch(self) -> int:
        cfg, rt = self.cfg, self.runtime
        batch = per_worker_batch(cfg.data.global_batch_size, rt.data_parallel_size, cfg.loop.grad_accum)
        per_device = getattr(rt, "local_devices", 1)
        if batch % per_device:
            raise ValueError(
                f"data.global_batch_size={cfg.data.global_batch_size} gives {batch} samples per worker, "
                f"not divisible by its {per_device} XLA devices"
            )
        return batch

    def _train_loader(self, dataset: Dataset) -> tuple[DataLoader, DistributedSampler]:
        cfg, rt = self.cfg, self.runtime
        batch = self._worker_batch()
        sampler = ResumableSampler(
            dataset,
            num_replicas=rt.data_parallel_size,
            rank=rt.data_parallel_rank,
            shuffle=cfg.data.shuffle,
            seed=cfg.run.seed,
            drop_last=True,
        )
        loader = DataLoader(
            dataset,
            batch_size=batch,
            sampler=sampler,
            drop_last=True,
            num_workers=cfg.data.num_workers,
            pin_memory=rt.device.type == "cuda",
            generator=torch.Generator().manual_seed(cfg.run.seed),  # keeps the global RNG untouched (resume)
        )
        self._check_batches(len(loader), len(dataset))
        return loader, sampler

    def _check_batches(self, batches: int, samples: int) -> None:
        if batches < self.cfg.loop.grad_accum:
            raise ValueError(
                f"the train split has {samples} samples: too few for one step of "
                f"{self.cfg.data.global_batch_size} (data.global_batch_size); add data or lower the batch"
            )

    def _eval_loader(self, dataset: Dataset) -> DataLoader:
        rt = self.runtime
        if len(dataset) < rt.data_parallel_size:
            raise ValueError(
                f"the eval split has {len(dataset)} samples, fewer than the {rt.data_parallel_size} workers"
            )
        shard = Subset(dataset, range(rt.data_parallel_rank, len(dataset), rt.data_parallel_size))
        batch = max(1, (self.cfg.data.eval_batch_size or self.cfg.data.global_batch_size) // rt.data_parallel_size)
        return DataLoader(shard, batch_size=batch, shuffle=False, num_workers=self.cfg.data.num_workers)

    def _setup_data(self) -> int:
        """Train and valid batches from the torch Datasets or the Ray Data shards; returns batches per epoch."""
        cfg, rt = self.cfg, self.runtime
        if cfg.data.loader == "ray":
            from raytpu.ingest import RayData

            self.ray_data = RayData(
                cfg, self.job, self.datasets, rt.data_parallel_rank, rt.data_parallel_size, self._worker_batch()
            )
            self.valid_loader = self.ray_data.eval_loader("valid")
            self._sample = self.ray_data.sample()  # shapes for the XLA input sharding
            batches = self.ray_data.batches_per_epoch()
            self._check_batches(batches, batches * self._worker_batch() * rt.data_parallel_size)
            return batches
        self.train_set = self.job.build_dataset(cfg, "train", self.data_root)
        self.valid_set = self.job.build_dataset(cfg, "valid", self.data_root)
        self.train_loader, self.sampler = self._train_loader(self.train_set)
        self.valid_loader = self._eval_loader(self.valid_set)
        self._sample = dict(self.train_set[0])  # shapes for the XLA input sharding
        return len(self.train_loader)

    def _epoch_batches(self, epoch: int, skip: int) -> Iterable:
        """CPU batches of ``epoch`` for this worker, less the first ``skip`` (a mid-epoch resume)."""
        if self.ray_data is not None:
            return self.ray_data.train_epoch(epoch, skip)
        self.sampler.set_epoch(epoch)
        if hasattr(self.train_set, "set_epoch"):
            self.train_set.set_epoch(epoch)
        self.sampler.skip(skip * self.train_loader.batch_size)
        return self.train_loader

    def _setup(self) -> None:
        cfg = self.cfg
        self._seed()
        self.steps_per_epoch = self._setup_data() // cfg.loop.grad_accum
        self.total_steps = cfg.loop.max_steps or cfg.loop.epochs * self.steps_per_epoch
        model = self.job.build_model(cfg)
        if cfg.checkpoint.weights:
            model.load_state_dict(ckpt.load_model_weights(cfg.checkpoint.weights), strict=True)
        self.model = self.runtime.prepare_model(model, self.job.find_unused_parameters)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.params)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, self.total_steps)
        self.ema = EMA(self.runtime.unwrap(self.model), cfg.loop.ema_beta) if cfg.loop.ema_beta else None
        self._ema_weights = {
            due: torch.tensor(1.0 - cfg.loop.ema_beta if due else 0.0, device=self.runtime.device)
            for due in (False, True)
        }
        self.nonfinite = torch.zeros((), device=self.runtime.device)
        self._reset_loss_since_report()
        self._restored_metrics: dict[str, float] = {}

    def _reset_loss_since_report(self) -> None:
        self._loss_since_report = torch.zeros((), device=self.runtime.device)
        self._steps_since_report = 0

    # ----------------------------------------------------------- resume
    def _restore(self) -> bool:
        if not self.cfg.checkpoint.resume:
            return False
        directory = self.reporter.latest_checkpoint()
        if directory is None:
            return False
        meta = ckpt.read_meta(directory)
        unwrapped = self.runtime.unwrap(self.model)
        unwrapped.load_state_dict(load_file(directory / ckpt.MODEL))
        if self.ema is not None and (directory / ckpt.EMA).is_file():
            self.ema.model.load_state_dict(load_file(directory / ckpt.EMA))
        state = ckpt.load_torch(directory / ckpt.TRAIN_STATE)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.runtime.load_scaler_state(state.get("scaler"))
        self.progress = Progress(
            step=meta["step"], epoch=meta["epoch"], best=meta.get("best"), reports=meta.get("reports", 0)
        )
        self._restored_metrics = meta.get("metrics", {})
        rng_file = directory / "rng" / f"rank_{self.rank}.pt"
        if rng_file.is_file():
            set_rng_states(self.runtime, ckpt.load_torch(rng_file))
        self._message(f"resumed from {directory} at step {self.progress.step} (epoch {self.progress.epoch})")
        return True

    # ------------------------------------------------------------- train
    def fit(self) -> dict[str, float]:
        self._setup()
        self._restore()
        p = self.progress
        self.logger = RunLogger(
            self.run_dir / "tensorboard",
            self.runtime.is_main,
            self.cfg.logging.tensorboard,
            self.cfg.logging.progress_bar,
            self.total_steps,
            p.step,
        )
        metrics: dict[str, float] = {}
        try:
            if p.step >= self.total_steps:
                self._message(f"run already complete at step {p.step}; nothing to do")
                return self._report_final_again()
            while p.step < self.total_steps:
                epoch_done = self._train_epoch()
                if epoch_done:
                    p.epoch += 1
                last = p.step >= self.total_steps
                per_epoch = epoch_done and not self.cfg.checkpoint.every_steps
                evaluate = last or (per_epoch and p.epoch % self.cfg.loop.eval_every_epochs == 0)
                if evaluate:
                    metrics = self.evaluate()
                if last or (epoch_done and not self.cfg.checkpoint.every_steps):
                    self._checkpoint(metrics)
            return metrics
        finally:
            self.runtime.finish()
            self.logger.close()

    def _report_final_again(self) -> dict[str, float]:
        """A complete run restarted (a resumed Tune trial whose last report was lost in
        the interruption): report the final checkpoint's metrics once more, without a
        new checkpoint, so whoever drives the run sees how it ended."""
        metrics = self._restored_metrics
        self.reporter.report(self._report_values(metrics), None, f"checkpoint_{self.progress.step:08d}")
        return metrics

    def _train_epoch(self) -> bool:
        """Train until the end of the epoch (True) or of the run (False)."""
        p, cfg = self.progress, self.cfg
        done_in_epoch = p.step - p.epoch * self.steps_per_epoch
        source = self._epoch_batches(p.epoch, done_in_epoch * cfg.loop.grad_accum)
        batches = self.runtime.device_loader(source, self._sample)
        self.model.train()
        self._last_log = (time.perf_counter(), p.step)
        for index in range(done_in_epoch, self.steps_per_epoch):
            compiles_before = self.runtime.compile_count()
            self._train_step(batches)
            p.step += 1
            self._after_step()
            self._guard_recompile(index - done_in_epoch, self.runtime.compile_count() - compiles_before)
            if cfg.checkpoint.every_steps and p.step % cfg.checkpoint.every_steps == 0 and p.step < self.total_steps:
                self._checkpoint(self.evaluate())  # every checkpoint carries a score, for best-of and Tune
            if p.step >= self.total_steps:
                return p.step % self.steps_per_epoch == 0
        return True

    def _train_step(self, batches: Iterator) -> None:
        p, cfg, rt = self.progress, self.cfg, self.runtime
        if cfg.loop.fail_at_step and p.step + 1 == cfg.loop.fail_at_step:
            raise RuntimeError(f"fault injected by loop.fail_at_step={cfg.loop.fail_at_step}")
        ctx = StepContext(epoch=p.epoch, step=p.step, training=True, config=cfg)
        with rt.compiled_step():
            self._forward_backward_update(batches, ctx)

    def _forward_backward_update(self, batches: Iterator, ctx: StepContext) -> None:
        """Everything of one optimizer step: the part that XLA compiles as one graph."""
        p, cfg, rt = self.progress, self.cfg, self.runtime
        accum = cfg.loop.grad_accum
        loss_sum = None
        for micro in range(accum):
            batch = next(batches)
            with rt.no_sync(self.model, skip=micro < accum - 1), rt.autocast():
                loss, extra = self.job.train_step(self.model, batch, ctx)
            rt.backward(loss / accum if accum > 1 else loss)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        grad_norm = rt.optimizer_step(self.optimizer, self.params, cfg.loop.clip_grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self._update_ema((p.step + 1) % cfg.loop.ema_every == 0)
        loss_mean = loss_sum.float() / accum
        self._loss_since_report = self._loss_since_report + loss_mean
        self._steps_since_report += 1
        self.nonfinite = torch.maximum(self.nonfinite, (~torch.isfinite(loss_mean)).float())
        extras = {k: v.detach().float() for k, v in extra.items() if k != "loss"}
        self._stats = torch.stack([loss_mean, grad_norm.float(), self.nonfinite, *extras.values()])
        self._stat_names = ["loss", "grad_norm", "nonfinite", *extras]

    def _update_ema(self, due: bool) -> None:
        """EMA every ``loop.ema_every`` steps; on static-graph runtimes (XLA) every step
        updates, with weight 0 when not due, so that one compiled step serves all."""
        model = self.runtime.unwrap(self.model)
        if self.runtime.static_graph:
            self.ema.update(model, self._ema_weights[due])
        elif due:
            self.ema.update(model)

    def _after_step(self) -> None:
        p, cfg = self.progress, self.cfg
        step = p.step
        if step % cfg.loop.log_every == 0 or step == self.total_steps:
            self.runtime.add_step_closure(self._log_closure, (self._stats, step, self.scheduler.get_last_lr()[0]))
        self.runtime.mark_step()
        if self._stop_reason:
            raise NonFiniteLossError(self._stop_reason)

    def _guard_recompile(self, steps_into_epoch: int, compiles: int) -> None:
        """After warm-up a training step must reuse its compiled graph.

        The first two steps of every epoch (and of a resumed run) may compile:
        the first builds the step, the second sees the optimizer state it
        created, and jobs may change graphs at an epoch (MSHNet's warm-up).
        """
        if compiles <= 0 or steps_into_epoch < 2:
            return
        self.recompiles += compiles
        text = (
            f"step {self.progress.step} recompiled the XLA graph ({compiles} compile(s)); "
            "rerun with PT_XLA_DEBUG_LEVEL=2 to see why (a changing shape, a Python value or a .item())"
        )
        if self.cfg.xla.strict_recompile:
            raise RecompileError(text + "; xla.strict_recompile=true stops the run")
        self._message(f"warning: {text}")

    def _log_closure(self, stats: torch.Tensor, step: int, lr: float) -> None:
        values = dict(zip(self._stat_names, stats.cpu().tolist()))
        if values.pop("nonfinite") > 0 and self.cfg.loop.stop_on_nonfinite:
            self._stop_reason = (
                f"non-finite loss before step {step} (last loss {values['loss']}); lower optim.lr, set "
                "loop.clip_grad_norm, or set loop.stop_on_nonfinite=false to continue"
            )
        warning = watch_grad_norm(
            values["grad_norm"], step, self.cfg.loop.grad_norm_warn_high, self.cfg.loop.grad_norm_warn_low
        )
        if warning:
            self._message(f"warning: {warning}")
        now = time.perf_counter()
        then, then_step = self._last_log
        steps = max(step - then_step, 1)
        step_time = (now - then) / steps
        self._last_log = (now, step)
        scalars = {f"train/{k}": v for k, v in values.items()}
        scalars.update(
            {
                "train/lr": lr,
                "perf/step_time_s": step_time,
                "perf/samples_per_s": self.cfg.data.global_batch_size / step_time,
                "train/epoch": float(self.progress.epoch),
            }
        )
        scalars.update(self.runtime.metrics())
        if self.runtime.name == "xla":
            scalars["xla/recompiles_after_warmup"] = float(self.recompiles)
        self.logger.scalars(scalars, step)
        self.logger.progress(step, {"loss": values["loss"], "lr": lr, "gnorm": values["grad_norm"]})

    # ----------------------------------------------------------- eval
    def eval_model(self) -> torch.nn.Module:
        return self.ema.model if self.ema is not None else self.runtime.unwrap(self.model)

    @torch.no_grad()
    def evaluate(self, loader: Iterable | None = None, prefix: str = "valid") -> dict[str, float]:
        model, rt = self.eval_model(), self.runtime
        rt.broadcast_buffers(model)
        model.eval()
        ctx = StepContext(epoch=self.progress.epoch, step=self.progress.step, training=False, config=self.cfg)
        totals: dict[str, torch.Tensor] = {}
        images = {}
        for index, batch in enumerate(rt.device_loader(loader or self.valid_loader)):
            with rt.autocast():
                stats = self.job.eval_step(model, batch, ctx)
                if index == 0 and rt.is_main and self.cfg.logging.eval_images and self.logger is not None:
                    images = self.job.eval_images(model, _first(batch, self.cfg.logging.eval_images), ctx)
            for key, value in stats.items():
                totals[key] = totals[key] + value if key in totals else value
            rt.mark_step()
        metrics = self.job.finish_eval(rt.all_reduce_sum(totals))
        metrics = {f"{prefix}/{k}": float(v) for k, v in metrics.items()}
        if self.logger is not None:
            self.logger.scalars(metrics, self.progress.step)
            self.logger.images({f"{prefix}/{k}": v for k, v in images.items()}, self.progress.step)
            self.logger.flush()
            self._message(f"step {self.progress.step} epoch {self.progress.epoch}: " + json.dumps(metrics))
        self.model.train()
        return metrics

    # ------------------------------------------------------ checkpoint
    def _score(self, metrics: dict[str, float]) -> float | None:
        key = f"valid/{self.job.main_metric}"
        value = metrics.get(key)
        p = self.progress
        if value is not None:
            better = p.best is None or (value > p.best if self.job.main_metric_mode == "max" else value < p.best)
            if better:
                p.best = value
        return p.best

    def _train_loss_since_report(self) -> dict[str, float]:
        """``train/loss``: the mean training loss over the steps since the last report,
        over all workers (a metric Tune can use as well as the validation ones)."""
        steps = self._steps_since_report
        total = self.runtime.all_reduce_sum({"loss": self._loss_since_report})["loss"]
        self._reset_loss_since_report()
        return {"train/loss": float(total) / (steps * self.runtime.world_size)} if steps else {}

    def _report_values(self, metrics: dict[str, float]) -> dict[str, Any]:
        """What one report carries: the metrics, where the run is, and the scores."""
        p = self.progress
        # finite: Ray's checkpoint snapshot is JSON, where an infinity comes back as null
        worst = -1e30 if self.job.main_metric_mode == "max" else 1e30
        return {
            **metrics,
            "step": p.step,
            "epoch": p.epoch,
            "report": p.reports,
            "score": metrics.get(f"valid/{self.job.main_metric}", worst),
            "best": p.best if p.best is not None else worst,
        }

    def _checkpoint(self, metrics: dict[str, float]) -> None:
        p, rt = self.progress, self.runtime
        self._score(metrics)
        metrics = {**metrics, **self._train_loss_since_report()}
        p.reports += 1
        report = self._report_values(metrics)
        with tempfile.TemporaryDirectory(prefix="raytpu-ckpt-") as tmp:
            directory = Path(tmp)
            ckpt.save_torch(directory / "rng" / f"rank_{self.rank}.pt", rng_states(rt))
            model_state = rt.to_cpu(rt.unwrap(self.model).state_dict())
            ema_state = rt.to_cpu(self.ema.model.state_dict()) if self.ema is not None else None
            train_state = rt.to_cpu(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": rt.scaler_state(),
                }
            )
            if rt.is_main:
                ckpt.save_weights(directory / ckpt.MODEL, model_state)
                if ema_state is not None:
                    ckpt.save_weights(directory / ckpt.EMA, ema_state)
                ckpt.save_torch(directory / ckpt.TRAIN_STATE, train_state)
                ckpt.save_json(
                    directory / ckpt.META,
                    {
                        "step": p.step,
                        "epoch": p.epoch,
                        "best": p.best,
                        "reports": p.reports,
                        "metrics": metrics,
                        "job": self.job.name,
                        "config": to_dict(self.cfg),
                    },
                )
            self.reporter.report(report, directory, f"checkpoint_{p.step:08d}")

    # ------------------------------------------------------------ test
    def test(self) -> dict[str, float]:
        """Evaluate the weights of ``checkpoint.weights`` on the test split (or the job's own test)."""
        cfg = self.cfg
        self._seed()
        model = self.job.build_model(cfg)
        model.load_state_dict(ckpt.load_model_weights(cfg.checkpoint.weights), strict=True)
        self.model = self.runtime.prepare_model(model)
        self.ema = None
        if type(self.job).test is not Job.test:
            if not self.runtime.is_main:
                return {}
            custom = self.job.test(self.runtime.unwrap(self.model), cfg, self.run_dir, self.data_root)
            return {f"test/{k}": float(v) for k, v in custom.items()}
        if cfg.data.loader == "ray":
            from raytpu.ingest import RayData

            rt = self.runtime
            self.ray_data = RayData(cfg, self.job, self.datasets, rt.data_parallel_rank, rt.data_parallel_size, 1)
            return self.evaluate(self.ray_data.eval_loader("test"), prefix="test")
        test_set = self.job.build_dataset(cfg, "test", self.data_root)
        return self.evaluate(self._eval_loader(test_set), prefix="test")

    def _message(self, text: str) -> None:
        if self.runtime.is_main:
            if self.logger is not None:
                self.logger.message(text)
            else:
                print(text, flush=True)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way (for mid-epoch resume)."""

    _skip = 0

    def skip(self, count: int) -> None:
        self._skip = count

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self._skip :]
        self._skip = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples


def _first(batch: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    return {k: v[:count] for k, v in batch.items()}


def rng_states(runtime: Runtime) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "runtime": runtime.rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
        "python": random.getstate(),
    }


def set_rng_states(runtime: Runtime, state: dict[str, Any]) -> None:
    runtime.set_rng_state(state["runtime"])
    keys = state["numpy"]["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy"]["pos"]))
    random.setstate(state["python"])


def train_worker_entry(payload: dict[str, Any]) -> None:
    """``train_loop_per_worker`` of the TorchTrainer: one call per Ray worker."""
    import ray.train

    from raytpu.config import from_dict
    from raytpu.runtime import make_runtime

    cfg, job = from_dict(payload["config"])
    run_dir = Path(payload["run_dir"])
    context = ray.train.get_context()
    cfg.xla.compile_cache = cfg.xla.compile_cache or str(run_dir / "xla_cache")
    if cfg.scaling.runtime == "xla" and cfg.scaling.tpu.accelerator_type and cfg.scaling.tpu.layout == "multiprocess":
        configure_chip_process(cfg, context.get_world_rank())
    runtime = make_runtime(
        cfg.scaling.runtime,
        cfg.scaling.precision,
        context.get_world_size(),
        context.get_world_rank(),
        context.get_local_rank(),
        cfg.xla,
    )
    reporter = RayReporter()
    datasets = {name: ray.train.get_dataset_shard(name) for name in payload.get("datasets", [])}
    trainer = Trainer(cfg, job, runtime, run_dir, Path(payload["data_root"]), reporter, datasets)
    if payload["mode"] == "train":
        trainer.fit()
        return
    metrics = trainer.test()
    with tempfile.TemporaryDirectory(prefix="raytpu-test-") as tmp:
        if runtime.is_main:
            ckpt.save_json(Path(tmp) / "test_metrics.json", metrics)
        reporter.report(metrics, Path(tmp) if runtime.is_main else None, "test")


def configure_chip_process(cfg: Config, world_rank: int) -> dict[str, str]:
    """Per-chip layout: give this process torch_xla's PJRT multi-process environment
    (before torch_xla is imported), from the slice spec and every worker's TPU worker id and
    host address (Ray does not order the hosts by worker id: ``raytpu.tpu.chip_process_env``)."""
    import ray
    import torch.distributed as dist

    from raytpu.tpu import apply_env, chip_process_env, slice_spec, tpu_worker_id

    spec = slice_spec(cfg.scaling.tpu.accelerator_type, cfg.scaling.tpu.topology)
    mine = (tpu_worker_id(ray.get_runtime_context().get_node_labels()), ray.util.get_node_ip_address())
    placements: list[tuple[int, str]] = [(0, "")] * dist.get_world_size()
    dist.all_gather_object(placements, mine)
    env = chip_process_env(world_rank, placements, spec)
    apply_env(env)
    return env
