"""The training loop: written once, for every job, runtime and ingest path.

:class:`Trainer` runs one worker's share of a run. It knows neither Ray nor a device: the
runtime (``raytpu.runtime``) moves tensors, reduces gradients and compiles; the worker data
(``raytpu.worker.data``) yields batches; the checkpointer (``raytpu.worker.state``) saves and
restores; the reporter sends reports where the run is watched (Ray Train, or a local folder);
callbacks (``raytpu.hooks.Callback``: the config's ``loop.callbacks``, the job's) observe. Per step
there is exactly one device sync; everything logged is read in a step closure, after the step's
graph ran, so nothing in the step waits on the host.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raytpu.config import Config, dump_yaml, to_dict
from raytpu.corpus.feeder import feeder_name
from raytpu.hooks import Callback, load_callbacks
from raytpu.job import Batch, CustomTest, DrawsImages, HasCallbacks, Job, StepContext, WritesText, in_warmup
from raytpu.records import checkpoints as ckpt
from raytpu.records.goodput import Command
from raytpu.records.resizes import Regrow
from raytpu.records.trackers import Trackers, open_trackers
from raytpu.runtime.base import Runtime
from raytpu.storage.run_folder import RunFolder, local_copy
from raytpu.worker import optim
from raytpu.worker.cadence import Cadence, Scoreboard
from raytpu.worker.data import WorkerData, make_worker_data
from raytpu.worker.flops import Throughput
from raytpu.worker.logger import RunLogger, watch_grad_norm
from raytpu.worker.optim import EMA, EMASchedule, base_lr_at, build_optimizer, build_scheduler
from raytpu.worker.reporting import Reporter
from raytpu.worker.state import Checkpointer, Progress, TrainState
from raytpu.worker.timing import ProfileWindow, StepClock


class NonFiniteLossError(RuntimeError):
    pass


@dataclass(frozen=True)
class Growth:
    """What an elastic run may grow to: its largest size, in steps of ``unit`` workers (a TPU slice's)."""

    largest: int
    unit: int = 1


class Trainer:
    def __init__(
        self,
        cfg: Config,
        job: Job,
        runtime: Runtime,
        run_dir: str | Path,
        data_root: Path,
        reporter: Reporter,
        datasets: dict[str, Any] | None = None,
        callbacks: Sequence[Callback] = (),
        command: Command | None = None,
        growth: Growth | None = None,
        board: str = "",
    ) -> None:
        """``datasets``: split -> Ray ``DataIterator``, read when ``data.loader`` is ``ray``.
        ``command``: the command this attempt belongs to, whose driver keeps the goodput record (rank
        0 adds the attempt's step phases to it); without one, no record is kept. ``growth``: an
        elastic run's largest size and its unit, to grow to at a checkpoint when the cluster has room.
        ``board``: the driver's progress board, where rank 0 posts its bar (a notebook's driver)."""
        self.cfg, self.job, self.runtime, self.growth, self.board = cfg, job, runtime, growth, board
        self.folder = RunFolder(run_dir)  # a local folder or a bucket prefix
        self.data_root, self.reporter = data_root, reporter
        self.datasets = datasets or {}
        job_callbacks = job.callbacks(cfg) if isinstance(job, HasCallbacks) else []
        self.callbacks = [*callbacks, *load_callbacks(cfg.loop.callbacks), *job_callbacks]
        self.progress = Progress()
        self.logger: RunLogger | None = None  # set by fit(); test mode has none
        self.data: WorkerData | None = None
        self.model: torch.nn.Module | None = None
        self.ema: EMA | None = None
        self.steps_per_epoch = 0
        self.total_steps = 0
        self.scoreboard = Scoreboard(cfg, job, runtime)
        self.weighs_items = optim.weighs_items(job, runtime, cfg.loop.grad_accum)
        self._stop_reason: str | None = None
        self._restored_metrics: dict[str, float] = {}
        self._preemption_saved = False
        self.throughput: Throughput | None = None  # set by _build (raytpu.worker.flops)
        self.command_id = command.id if command is not None else ""
        self.checkpointer = Checkpointer(runtime, job.name, to_dict(cfg), self.command_id)
        recorded = runtime.is_main and command is not None  # rank 0 of a command's run keeps the record
        self.clock = StepClock(
            self.folder if recorded else None, command or Command(), runtime.compile_seconds, runtime.world_size
        )
        steps, ranks = cfg.loop.profile_steps, cfg.loop.profile_ranks
        traced = bool(steps) and runtime.rank in ranks
        self.profile = ProfileWindow(runtime, self.folder.local("profile"), *steps) if traced else None

    # ------------------------------------------------------------ build
    def _seed(self) -> None:
        """A seed per data-parallel share: a tensor group's workers draw the same dropout and augmentation."""
        seed = self.cfg.run.seed * 1000 + self.runtime.data_parallel_rank
        random.seed(seed)
        np.random.seed(seed)
        self.runtime.seed(seed)

    def _build(self) -> None:
        cfg, rt = self.cfg, self.runtime
        self._seed()
        feeder = feeder_name(self.command_id, cfg.run.name)
        self.data = make_worker_data(cfg, self.job, rt, self.data_root, self.datasets, feeder=feeder)
        self.sample = self.data.sample()
        self.steps_per_epoch = self.data.batches_per_epoch() // cfg.loop.grad_accum
        self.total_steps = cfg.loop.max_steps or cfg.loop.epochs * self.steps_per_epoch
        self.cadence = Cadence(
            self.total_steps, cfg.checkpoint.every_steps, cfg.loop.eval_every_epochs, cfg.loop.eval_every_steps
        )
        model = rt.build(lambda: self.job.build_model(cfg))
        self.throughput = Throughput(self.job, cfg, model, rt)
        if self.throughput.note:
            self._message(self.throughput.note)
        if cfg.checkpoint.weights:
            ckpt.load_into(model, ckpt.load_model_weights(cfg.checkpoint.weights))
        self.model = rt.prepare_model(model, in_warmup(self.job, cfg, 0), cfg.loop.sync_batchnorm)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg.optim, self.model, fused=rt.fused_optimizer)
        self.scheduler = build_scheduler(cfg.optim, self.optimizer, self.total_steps)
        self.ema = EMA(rt.unwrap(self.model)) if cfg.loop.ema_beta else None
        self.ema_schedule = EMASchedule.from_loop(cfg.loop)
        self.loss_total = torch.zeros((), device=rt.device)  # the sum of every step's loss since the start
        self.scoreboard.reset_loss()

    @property
    def state(self) -> TrainState:
        return TrainState(self.model, self.ema.model if self.ema else None, self.optimizer, self.scheduler)

    def _resume(self) -> None:
        """Continue from the newest checkpoint that reads back whole (a damaged one, a crash
        mid-write or a bad disk, is skipped with a warning that names it); or, with
        ``checkpoint.resume_from``, from that checkpoint, unless an earlier attempt of this same
        command wrote a newer one. Training then goes on with the configured base lr."""
        start = self.cfg.checkpoint.resume_from
        with contextlib.ExitStack() as copies:  # local copies of a bucket's checkpoints, until restored
            own = self._own_checkpoint(copies) if self.cfg.checkpoint.resume else None
            if start and (own is None or own[0]["meta"].get("command") != self.command_id):
                own = self.checkpointer.read(copies.enter_context(local_copy(start))), start
            if own is not None:
                loaded, where = own
                self.progress, self._restored_metrics = self.checkpointer.restore(loaded, self.state)
                self._message(f"resumed from {where} at step {self.progress.step} (epoch {self.progress.epoch})")
        self.progress.went_on_with(base_lr_at(self.cfg.optim, self.progress.step))

    def _own_checkpoint(self, copies: contextlib.ExitStack) -> tuple[dict[str, Any], str] | None:
        """The run's newest checkpoint that reads back whole, read, and where it is."""
        candidates = copies.enter_context(contextlib.closing(self.reporter.resume_candidates()))
        for directory in candidates:
            where = self.reporter.location_of(directory)
            try:
                return self.checkpointer.read(directory), where
            except ckpt.CheckpointError as exc:
                self._message(f"warning: skipping checkpoint {where}: {exc}; trying an older one")
        return None

    # ------------------------------------------------------------- train
    def fit(self) -> dict[str, float]:
        self._build()
        self.clock.mark("built")
        self._resume()
        self.clock.mark("resumed")
        cfg = self.cfg
        trackers = self._open_trackers()
        self.logger = RunLogger(
            self.folder,
            self.runtime.is_main,
            cfg.logging.tensorboard and "tensorboard" in cfg.logging.report_to,
            cfg.logging.progress_bar,
            self.total_steps,
            self.progress.step,
            cfg.logging.flush_every_s,
            trackers,
            self.board,
        )
        self.logger.config(dump_yaml(cfg), self.progress.step)
        self.logger.parameters(to_dict(cfg))
        completed = False
        try:
            if self.progress.step >= self.total_steps:
                self._message(f"run already complete at step {self.progress.step}; nothing to do")
                return self._report_final_again()
            metrics = self._train()
            self.clock.record(final=True)
            if cfg.logging.hparams:
                self.logger.hyperparameters(to_dict(cfg), [f"valid/{self.job.main_metric}", "train/loss"])
            self.logger.tracked({"goodput": self.clock.goodput()}, self.progress.step)
            completed = self.progress.step >= self.total_steps
            return metrics
        finally:
            self.runtime.finish()
            self.logger.close(completed)

    def _open_trackers(self) -> Trackers | None:
        """Rank 0's trackers of ``logging.report_to`` (MLflow, W&B), continuing their runs when this
        run resumed from a checkpoint or an earlier attempt of its command made them; each opens on
        a thread of its own, so a tracker that does not answer costs a warning, not the attempt."""
        if not self.runtime.is_main or not set(self.cfg.logging.report_to) - {"tensorboard"}:
            return None
        resumed = self.progress.step > 0
        log = self.cfg.logging
        return open_trackers(log, self.folder, self.cfg.run.name, resumed, self._message, self.command_id)

    def _train(self) -> dict[str, float]:
        p = self.progress
        metrics: dict[str, float] = {}
        while p.step < self.total_steps:
            done_in_epoch = p.step - p.epoch * self.steps_per_epoch
            source = self.data.epoch(p.epoch, done_in_epoch * self.cfg.loop.grad_accum)
            batches = self.runtime.device_loader(source, self.sample)
            unused = in_warmup(self.job, self.cfg, p.epoch)  # a warm-up leaves some parameters without gradient
            self.model = self.runtime.track_unused_parameters(self.model, unused)
            self.model.train()
            self.throughput.since(p.step)
            for index in range(done_in_epoch, self.steps_per_epoch):
                self._step(batches, index - done_in_epoch)
                epoch_ended = index == self.steps_per_epoch - 1
                if epoch_ended:
                    p.epoch += 1
                evaluate, checkpoint = self.cadence.decide(p.step, epoch_ended, p.epoch)
                if evaluate:
                    metrics = self.evaluate()
                if checkpoint:
                    self._checkpoint(metrics if evaluate else {})
                    self._grow_if_room()
                if self._interrupted(checkpoint):
                    return metrics
                if p.step >= self.total_steps:
                    break
        return metrics

    def _grow_if_room(self) -> None:
        """An elastic run below its largest size, at a checkpoint: when the cluster now has room for
        more workers, the group stops once that checkpoint is stored (:class:`Regrow`) and Ray
        Train starts it again at the size that fits, from there: a growth loses no work."""
        growth, p = self.growth, self.progress
        if growth is None or self.runtime.world_size >= growth.largest or p.step >= self.total_steps:
            return
        if self.reporter.room_to_grow(growth.unit):
            self.reporter.flush()
            self._message(
                f"room for more than {self.runtime.world_size} workers: step {p.step} is checkpointed; "
                "the group restarts larger"
            )
            raise Regrow(p.step, self.runtime.world_size)

    def _report_final_again(self) -> dict[str, float]:
        """A complete run restarted (a resumed Tune trial whose last report was lost in
        the interruption): report the final checkpoint's metrics once more, without a
        new checkpoint, so whoever drives the run sees how it ended."""
        metrics = self._restored_metrics
        values = self.scoreboard.values(self.progress, metrics, scored=True)
        self.reporter.report(values, None, f"checkpoint_{self.progress.step:08d}")
        return metrics

    def _step(self, batches: Iterator[Batch], steps_into_epoch: int) -> None:
        p, cfg, rt = self.progress, self.cfg, self.runtime
        for callback in self.callbacks:
            callback.on_step_start(self, p.step + 1)
        if self.profile is not None:
            self.profile.before(p.step + 1)
        self.clock.step_started()
        rt.begin_step(p.step)
        ctx = StepContext(epoch=p.epoch, step=p.step, training=True, config=cfg)
        tracing = self.profile is not None and self.profile.tracing
        traced = rt.step_trace(p.step + 1) if tracing else contextlib.nullcontext()
        logs = (p.step + 1) % cfg.loop.log_every == 0 or p.step + 1 == self.total_steps
        with traced, rt.compiled_step():
            self._forward_backward_update(batches, ctx, logs)
        p.step += 1
        if logs:
            rt.add_step_closure(self._log, (self._stats, p.step, self.scheduler.get_last_lr()[0]))
        rt.mark_step()
        if self._stop_reason:
            raise NonFiniteLossError(self._stop_reason)
        warning = rt.end_step(p.step, steps_into_epoch)
        if warning:
            self._message(f"warning: {warning}")
        self.clock.step_ended()
        if self.profile is not None and self.profile.after(p.step):
            self.folder.sync("profile")  # the trace, into the bucket when the run is there
        for callback in self.callbacks:
            callback.on_step_end(self, p.step)

    def _forward_backward_update(self, batches: Iterator[Batch], ctx: StepContext, logs: bool) -> None:
        """Everything of one optimizer step: the part that XLA compiles as one graph. The statistics
        only a log reads (the gradient norm unless clipping needs it, the stacked values) are
        computed on the steps that ``logs`` on eager runtimes, where each is a kernel launch, and on
        every step on a static-graph one, where computing them in one step only would be a second graph."""
        p, cfg, rt = self.progress, self.cfg, self.runtime
        accum = cfg.loop.grad_accum
        loss_sum, scales = None, None
        if self.weighs_items:  # each micro-batch weighted by its items: the step's batches first
            with self.clock.phase("input"):
                batches, scales = optim.loss_scales(self.job, rt, [next(batches) for _ in range(accum)])
        for micro in range(accum):
            with self.clock.phase("input"):
                batch = next(batches)
            with rt.no_sync(self.model, skip=micro < accum - 1), rt.autocast():
                loss, extra = self.job.train_step(self.model, batch, ctx)
            rt.backward(loss * scales[micro] if scales else loss / accum if accum > 1 else loss)
            weighed = loss.detach() * scales[micro] if scales else loss.detach()
            loss_sum = weighed if loss_sum is None else loss_sum + weighed
        measured = logs or rt.static_graph
        grad_norm = rt.optimizer_step(self.optimizer, self.params, cfg.loop.clip_grad_norm, measure=measured)
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.step(rt.unwrap(self.model), self.ema_schedule.weight(p.step), rt.static_graph, rt.device)
        loss_mean = loss_sum.float() / (sum(scales).clamp_min(1e-12) if scales else accum)  # this worker's mean
        self.scoreboard.add_loss(loss_mean)
        self.loss_total = self.loss_total + loss_mean  # one non-finite loss keeps it non-finite: the stop check
        if measured:
            extras = {k: v.detach().float() for k, v in extra.items() if k != "loss"}
            self._stats = torch.stack([loss_mean, grad_norm.float(), self.loss_total, *extras.values()])
            self._stat_names = ["loss", "grad_norm", "loss_total", *extras]

    def _log(self, stats: torch.Tensor, step: int, lr: float) -> None:
        """The step closure of a log step: its values, read back once the step's graph ran."""
        cfg = self.cfg
        values = dict(zip(self._stat_names, stats.cpu().tolist()))
        if not math.isfinite(values.pop("loss_total")) and cfg.loop.stop_on_nonfinite:
            self._stop_reason = (
                f"non-finite loss before step {step} (last loss {values['loss']}); lower optim.lr, set "
                "loop.clip_grad_norm, or set loop.stop_on_nonfinite=false to continue"
            )
        warning = watch_grad_norm(values["grad_norm"], step, cfg.loop.grad_norm_warn_high, cfg.loop.grad_norm_warn_low)
        if warning:
            self._message(f"warning: {warning}")
        perf = self.throughput.scalars(step)
        scalars = {**{f"train/{k}": v for k, v in values.items()}, "train/lr": lr, **perf, **self.runtime.metrics()}
        scalars.update({"train/epoch": float(self.progress.epoch), "scaling/workers": float(self.runtime.world_size)})
        self.logger.scalars(scalars, step)
        mfu = {"mfu": f"{perf['perf/mfu']:.1%}"} if "perf/mfu" in perf else {}
        self.logger.progress(step, {"loss": values["loss"], "lr": lr, "gnorm": values["grad_norm"], **mfu})
        for callback in self.callbacks:
            callback.on_log(self, step, values)

    # ----------------------------------------------------------- eval
    def eval_model(self) -> torch.nn.Module:
        return self.ema.model if self.ema is not None else self.runtime.unwrap(self.model)

    def weights_epoch(self) -> int:
        """The epoch whose training produced the current weights (0 before any step)."""
        return max(self.progress.step - 1, 0) // max(self.steps_per_epoch, 1)

    def evaluate(self, split: str = "valid") -> dict[str, float]:
        """The job's metrics on ``split``, summed over batches and workers."""
        with self.clock.phase("evaluation"):
            return self._evaluate(split)

    @torch.no_grad()
    def _evaluate(self, split: str) -> dict[str, float]:
        model, rt = self.eval_model(), self.runtime
        rt.broadcast_buffers(model)
        model.eval()
        epoch = self.weights_epoch() if split == "valid" else self.progress.epoch
        ctx = StepContext(epoch=epoch, step=self.progress.step, training=False, config=self.cfg, split=split)
        totals: dict[str, torch.Tensor] = {}
        images = {}
        drawn = rt.is_main or rt.sharded  # a sharded model's forward needs every rank; rank 0's result is kept
        batches = rt.even_batches(rt.device_loader(self.data.eval_batches(split)))
        for index, (batch, counted) in enumerate(batches):
            with rt.autocast():
                stats = self.job.eval_step(model, batch, ctx)
                if index == 0 and drawn and self.cfg.logging.eval_images and self.logger is not None:
                    images = self._images(model, batch, ctx)
            for key, value in stats.items() if counted else ():
                totals[key] = totals[key] + value if key in totals else value
            rt.mark_step()
        metrics = self.job.finish_eval(rt.all_reduce_sum(totals))
        metrics = {f"{split}/{k}": float(v) for k, v in metrics.items()}
        if self.logger is not None:
            texts = self._texts(model, ctx) if drawn and split == "valid" else {}
            self.logger.scalars(metrics, self.progress.step)
            self.logger.images({f"{split}/{k}": v for k, v in images.items()}, self.progress.step)
            self.logger.texts({f"{split}/{k}": v for k, v in texts.items()}, self.progress.step)
            self.logger.flush()
            self._message(f"step {self.progress.step} epoch {self.progress.epoch}: " + json.dumps(metrics))
        self.model.train()
        for callback in self.callbacks:
            callback.on_eval(self, split, metrics)
        return metrics

    def _images(self, model: torch.nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        if not isinstance(self.job, DrawsImages):
            return {}
        return self.job.eval_images(model, _first(batch, self.cfg.logging.eval_images), ctx)

    def _texts(self, model: torch.nn.Module, ctx: StepContext) -> dict[str, str]:
        return self.job.eval_text(model, ctx, self.data_root) if isinstance(self.job, WritesText) else {}

    # ------------------------------------------------------ checkpoint
    def _checkpoint(self, metrics: dict[str, float], reason: str = "scheduled") -> None:
        with self.clock.phase("checkpointing"):
            self._write_checkpoint(metrics, reason)

    def _write_checkpoint(self, metrics: dict[str, float], reason: str) -> None:
        board, p = self.scoreboard, self.progress
        scored = board.counts_for_best(metrics, self.weights_epoch())
        if scored:
            board.update_best(p, metrics)
        metrics = {**metrics, **board.train_loss()}
        p.reports += 1
        report = {**board.values(p, metrics, scored), "goodput": self.clock.goodput()}
        directory = Path(tempfile.mkdtemp(prefix="raytpu-ckpt-"))  # the reporter's once reported
        try:
            self.checkpointer.save(directory, self.state, p, metrics, reason)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.clock.record()  # once a checkpoint, before it can be resumed from: a kill after it loses no time
        name = f"checkpoint_{p.step:08d}"
        self.logger.drain_trackers()
        self.reporter.report(report, directory, name)
        self.logger.tags({"latest_checkpoint": self.folder.uri(name)})
        if scored and report["score"] == report["best"]:
            self.logger.tags({"best_checkpoint": self.folder.uri(name), "best_step": str(p.step)})
        for callback in self.callbacks:
            callback.on_checkpoint(self, report)

    def _interrupted(self, checkpointed: bool) -> bool:
        """At every log step (the same steps on every rank) ask the reporter, which gives every
        rank the same answer, whether to stop now (the driver got a signal) or to checkpoint now
        (Ray says a node of the run is being preempted; once per run). Either way the current
        step is checkpointed, without an eval, so never as the best. True: stop training."""
        p = self.progress
        if p.step % self.cfg.loop.log_every or p.step >= self.total_steps:
            return False
        reason = self.reporter.interruption()
        if reason is None or (reason == "preempted" and self._preemption_saved):
            return False
        self._message(f"{reason}: checkpointing step {p.step}" + (" and stopping" if reason == "stop" else ""))
        if not checkpointed:
            self._checkpoint({}, reason)
        self._preemption_saved = self._preemption_saved or reason == "preempted"
        return reason == "stop"

    # ------------------------------------------------------------ test
    def test(self) -> dict[str, float]:
        """Evaluate the weights of ``checkpoint.weights`` on the test split (or the job's own test)."""
        cfg, rt = self.cfg, self.runtime
        self._seed()
        model = self.job.build_model(cfg)
        ckpt.load_into(model, ckpt.load_model_weights(cfg.checkpoint.weights))
        self.model = rt.prepare_model(model, sync_batchnorm=cfg.loop.sync_batchnorm)
        self.ema = None
        if isinstance(self.job, CustomTest):
            return self._custom_test()
        self.data = make_worker_data(cfg, self.job, rt, self.data_root, self.datasets, mode="test")
        return self.evaluate("test")

    def _custom_test(self) -> dict[str, float]:
        """The job's own test (CDEIT's sampler) on rank 0, whose metrics and files are the test's;
        a sharded model's every forward is a collective, so there every rank runs it, the others
        into a folder they then remove."""
        rt = self.runtime
        if not (rt.is_main or rt.sharded):
            return {}
        out = self.folder.local() if rt.is_main else Path(tempfile.mkdtemp(prefix="raytpu-test-"))
        try:
            custom = self.job.test(rt.unwrap(self.model), self.cfg, out, self.data_root)
        finally:
            if not rt.is_main:
                shutil.rmtree(out, ignore_errors=True)
        if not rt.is_main:
            return {}
        self.folder.sync()  # what the test wrote (sample images): into the bucket when the run is there
        return {f"test/{k}": float(v) for k, v in custom.items()}

    def _message(self, text: str) -> None:
        if self.runtime.is_main:
            if self.logger is not None:
                self.logger.message(text)
            else:
                print(text, flush=True)


def _first(batch: Batch, count: int) -> Batch:
    return {k: v[:count] for k, v in batch.items()}
