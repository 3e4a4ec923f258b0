"""Rank-0 logging: TensorBoard event files, the trackers of ``logging.report_to`` (MLflow, W&B:
``raytpu.worker.trackers``) and a console progress bar."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from tqdm.auto import tqdm

from raytpu.records.checkpoints import CheckpointWriteError
from raytpu.records.progress import BoardPoster
from raytpu.records.trackers import WANDB, Trackers
from raytpu.storage.run_folder import RunFolder

#: the run folder's TensorBoard log dir
TENSORBOARD = "tensorboard"


class RunLogger:
    """Writes scalars/images to TensorBoard and drives a tqdm bar; silent off rank 0. The event files
    go to the run folder's ``tensorboard/``: in a bucket they are staged locally and copied up at
    every flush (each evaluation) and, so that TensorBoard shows a run's curves while an epoch runs,
    every ``flush_every_s`` seconds by a thread of their own, off the training path."""

    def __init__(
        self,
        folder: RunFolder,
        enabled: bool,
        tensorboard: bool,
        progress_bar: bool,
        total: int,
        initial: int,
        flush_every_s: float = 0.0,
        trackers: Trackers | None = None,
        board: str = "",
    ) -> None:
        """``trackers``: where the same scalars go besides TensorBoard (rank 0's); ``board``: the
        driver's progress board, which draws the bar instead (``raytpu.records.progress``)."""
        self.enabled, self.folder = enabled, folder
        self.trackers = trackers if trackers is not None else Trackers({}, print)
        self.writer = None
        self.bar = None
        self.poster = None
        self._closing = threading.Event()
        self._uploader: threading.Thread | None = None
        if not enabled:
            return
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            quiet_event_writer_threads()
            with self.events():
                self.writer = SummaryWriter(log_dir=str(folder.local(TENSORBOARD)), flush_secs=flush_every_s or 120)
            if folder.remote and flush_every_s > 0:
                self._uploader = threading.Thread(
                    target=self._upload_every, args=(flush_every_s,), name="raytpu-tensorboard-upload", daemon=True
                )
                self._uploader.start()
        if progress_bar and board:
            self.poster = BoardPoster.find(board, total)
        if progress_bar and self.poster is None:
            self.bar = tqdm(
                total=total, initial=initial, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True
            )

    @contextlib.contextmanager
    def events(self) -> Iterator[None]:
        """Writing TensorBoard events: a full disk (or a folder that cannot be written) as the
        one-line error of a checkpoint that cannot be written, which stops the run the same way."""
        try:
            yield
        except OSError as exc:
            raise CheckpointWriteError.of(exc, self.folder.local(TENSORBOARD), "the TensorBoard events") from exc

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.trackers.scalars(values, step)
        if self.writer is None:
            return
        with self.events():
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)

    def images(self, images: dict[str, torch.Tensor], step: int) -> None:
        if self.writer is None:
            return
        with self.events():
            for key, value in images.items():
                self.writer.add_images(key, value.detach().float().clamp(0, 1).cpu(), step)

    def texts(self, texts: dict[str, str], step: int) -> None:
        if self.writer is None:
            return
        with self.events():
            for key, value in texts.items():
                self.writer.add_text(key, value, step)

    def config(self, text: str, step: int) -> None:
        """The whole config as YAML ``text`` (tag ``config``), at each start: a resumed run, or one
        whose batch the finder stepped down, shows at that step what it trains with from there."""
        if self.writer is not None:
            with self.events():
                self.writer.add_text("config", "    " + text.replace("\n", "\n    "), step)  # a markdown code block

    def parameters(self, config: dict[str, Any]) -> None:
        """The config's single values, as the trackers' run parameters (a new tracker run's only)."""
        self.trackers.params(dotted_values(config))

    def tags(self, values: dict[str, str]) -> None:
        """Facts of the run the trackers show beside its parameters (the best checkpoint's location)."""
        self.trackers.tags(values)

    def drain_trackers(self) -> None:
        """Wait until the trackers have sent everything logged so far (before a checkpoint is
        reported: a run that resumes from it re-logs only the steps after it)."""
        self.trackers.drain()

    def tracked(self, values: dict[str, float], step: int) -> None:
        """Scalars for the trackers only (the run's goodput at its end: TensorBoard gets the
        driver's, which counts the start-up too)."""
        self.trackers.scalars(values, step)

    def hyperparameters(self, config: dict[str, Any], metrics: list[str]) -> None:
        """The config's single values under dotted names in the HPARAMS tab, lined up against
        ``metrics`` (tags the run logs as scalars). Written when training completes: TensorBoard
        keeps the first record of a run, and an attempt that fails (or is stopped) is not the one
        whose settings produced the metrics."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        with self.events():
            for summary in hparams(dotted_values(config), dict.fromkeys(metrics, 0.0)):
                self.writer.file_writer.add_summary(summary)

    def progress(self, step: int, postfix: dict[str, Any]) -> None:
        shown = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()}
        if self.poster is not None:
            self.poster.post(step, shown)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(shown, refresh=True)

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def flush(self) -> None:
        if self.writer is not None:
            with self.events():
                self.writer.flush()
            self.folder.sync(TENSORBOARD)

    def _upload_every(self, seconds: float) -> None:
        """Copy the event files up every ``seconds`` until the logger closes; a store that does not
        answer for a while costs this thread a round, never the step."""
        while not self._closing.wait(seconds):
            try:
                self.flush()
            except OSError as exc:
                print(f"warning: TensorBoard events not copied to {self.folder.location} this round ({exc})")

    def close(self, completed: bool = True) -> None:
        """``completed``: the run ended its training (the trackers' runs end as finished, else killed)."""
        self.trackers.close(completed)
        if self.trackers and self.folder.remote:
            self.folder.sync(WANDB)  # a W&B run's files (an offline run's whole history)
        self._closing.set()
        if self._uploader is not None:
            self._uploader.join()
        if self.bar is not None:
            self.bar.close()
        if self.poster is not None and completed:
            self.poster.post(self.poster.total)
        if self.writer is not None:
            with self.events():
                self.writer.close()
            self.folder.sync(TENSORBOARD)


def quiet_event_writer_threads() -> None:
    """TensorBoard's event-writing thread re-raises a failed write, which prints its traceback; the
    same error is raised again in the loop at its next event, where it becomes one line
    (:meth:`RunLogger.events`). So that thread's OSErrors stay silent in this process."""
    previous = threading.excepthook
    if getattr(previous, "quiet_event_writers", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.quiet_event_writers = True  # type: ignore[attr-defined]
    threading.excepthook = hook


def dotted_values(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The single values (numbers, strings, booleans) of a nested dict under dotted keys; lists
    become their text, empty ones and mappings with nothing in them are left out."""
    values: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            values.update(dotted_values(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            values[name] = value
        elif isinstance(value, (list, tuple)) and value:
            values[name] = str(list(value))
    return values


def watch_grad_norm(norm: float, step: int, high: float, low: float) -> str | None:
    """A warning text when the gradient norm looks wrong, else ``None``."""
    if not math.isfinite(norm):
        return f"step {step}: gradient norm is {norm}"
    if norm > high:
        return (
            f"step {step}: gradient norm {norm:.3g} > {high:g} (exploding?); consider loop.clip_grad_norm or a lower lr"
        )
    if norm < low:
        return f"step {step}: gradient norm {norm:.3g} < {low:g} (vanishing?); check the loss and the lr"
    return None
