"""The training loop in-process on the cpu runtime (no Ray): resume, accumulation, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raytpu.config import ConfigError, load_config, with_values
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.worker.loop import NonFiniteLossError, Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import tensorboard_hparams
from tests.toy_job import ToyJob

BASE = [
    "job.name=tests.toy_job",
    "data.global_batch_size=8",
    "loop.log_every=2",
    "optim.lr=0.05",
    "logging.progress_bar=false",
]


def run(run_dir: Path, *overrides: str) -> Trainer:
    cfg, job = load_config(None, BASE + list(overrides))
    trainer = Trainer(cfg, job, make_runtime("cpu", "auto", 1, 0, 0), run_dir, run_dir, FolderReporter(run_dir))
    trainer.fit()
    return trainer


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = FolderReporter(run_dir).latest_checkpoint()
    assert latest is not None
    return load_file(latest / ckpt.MODEL)


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path):
    schedule = [
        "loop.epochs=3",
        "checkpoint.every_steps=5",
        "optim.scheduler=cosine",
        "loop.ema_beta=0.9",
        "loop.ema_update_after=3",
    ]
    run(tmp_path / "straight", *schedule)
    with pytest.raises(RuntimeError, match="fault injected"):
        run(tmp_path / "broken", *schedule, "job.fail_at_step=13")
    assert ckpt.read_meta(FolderReporter(tmp_path / "broken").latest_checkpoint())["step"] == 10
    resumed = run(tmp_path / "broken", *schedule)
    assert resumed.progress.step == 24
    straight, again = final_weights(tmp_path / "straight"), final_weights(tmp_path / "broken")
    for key in straight:
        torch.testing.assert_close(again[key], straight[key], rtol=0, atol=0)


def test_resume_from_another_run_s_checkpoint_goes_on_from_its_step_with_the_configured_lr(tmp_path):
    """``checkpoint.resume_from``: the whole state of another run's checkpoint (its step), the
    lr this run is configured with from there, both lrs in the checkpoints' ``lr_steps``; and,
    from the base lr's changes (``optim.lr_changes``), the same weights as the run that changed it."""
    schedule = ["loop.epochs=2", "checkpoint.every_steps=5", "optim.warmup_steps=3"]
    run(tmp_path / "donor", *schedule, "loop.max_steps=5")  # its last checkpoint: step 5
    donor = tmp_path / "donor" / "checkpoint_00000005"
    went_on = run(tmp_path / "taker", *schedule, "optim.lr=0.02", f"checkpoint.resume_from={donor}")
    assert went_on.progress.step == 16 and went_on.progress.lr_steps == [[0, 0.05], [5, 0.02]]
    base = went_on.scheduler.base_lrs[0]
    assert base == 0.02 and went_on.optimizer.param_groups[0]["lr"] == pytest.approx(
        base * went_on.scheduler.lr_lambdas[0](16)
    )
    latest = FolderReporter(tmp_path / "taker").latest_checkpoint()
    assert ckpt.read_meta(latest)["lr_steps"] == [[0, 0.05], [5, 0.02]]
    run(tmp_path / "replayed", *schedule, "optim.lr_changes={5: 0.02}")
    taken, again = final_weights(tmp_path / "taker"), final_weights(tmp_path / "replayed")
    for key in taken:
        torch.testing.assert_close(again[key], taken[key], rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    common = ["loop.epochs=1", "job.dropout=0.0", "optim.name=sgd", "optim.momentum=0.0"]
    run(tmp_path / "full", *common)
    run(tmp_path / "accum", *common, "loop.grad_accum=2")
    full, accum = final_weights(tmp_path / "full"), final_weights(tmp_path / "accum")
    for key in full:
        torch.testing.assert_close(accum[key], full[key], rtol=1e-5, atol=1e-6)


def test_non_finite_loss_stops_with_a_clear_error(tmp_path):
    with pytest.raises(NonFiniteLossError, match="lower optim.lr"):
        run(tmp_path, "loop.epochs=5", "optim.lr=1e6", "optim.name=sgd")


def test_global_batch_not_divisible_by_workers_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="not divisible by 2 data-parallel workers"):
        load_config(None, BASE + ["data.global_batch_size=7", "scaling.num_workers=2"])
    cfg, job = load_config(None, BASE + ["data.global_batch_size=6", "xla.spmd=true"])
    runtime = make_runtime("cpu", "auto", 1, 0, 0)
    runtime.__class__ = type("FourDevices", (type(runtime),), {"local_devices": 4})  # a host of 4 chips
    with pytest.raises(ConfigError, match="gives 6 samples per worker, not divisible by its 4 devices"):
        Trainer(cfg, job, runtime, tmp_path, tmp_path, FolderReporter(tmp_path)).fit()


def test_completed_run_is_not_retrained_and_reports_its_end_again(tmp_path):
    first = run(tmp_path, "loop.epochs=2")
    before = final_weights(tmp_path)
    again = run(tmp_path, "loop.epochs=2")
    assert again.progress.step == 16
    torch.testing.assert_close(final_weights(tmp_path)["0.weight"], before["0.weight"])
    # one report, the last one of the first run (counted across runs: report 2, train/loss kept)
    timeless = {k: v for k, v in first.reporter.reports[-1].items() if k != "goodput"}  # goodput: the run's own time
    assert again.reporter.reports == [timeless]
    assert [r["report"] for r in first.reporter.reports] == [1, 2]
    assert "train/loss" in again.reporter.reports[0]


def test_checkpoints_are_complete_and_pruned_to_the_best_and_the_latest(tmp_path):
    reporter = run(tmp_path, "loop.epochs=2", "checkpoint.every_steps=3", "checkpoint.num_to_keep=2").reporter
    scores = {f"checkpoint_{r['step']:08d}": r["score"] for r in reporter.reports}  # steps 3, 6, ..., 15, 16
    best_two = sorted(scores, key=scores.get)[:2]  # valid/mse: lower is better
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint_"))
    assert kept == sorted({*best_two, "checkpoint_00000016"})
    meta = ckpt.read_meta(tmp_path / kept[-1])
    assert meta["step"] == 16 and "valid/mse" in meta["metrics"]
    assert (tmp_path / kept[-1] / "rng" / "rank_0.pt").is_file()


def test_one_retention_rule_the_best_and_the_latest_and_a_tie_goes_to_the_newer():
    """Ray Train's rule, which the run folder's reporter applies too: the num_to_keep best by score,
    plus the latest; of equal scores the newer ranks higher (the best of a tie is the newest)."""
    from raytpu.records.reports import Entry, best_of, retained

    entries = [Entry(f"c{n}", score, n) for n, score in enumerate([0.5, 0.9, 0.9, 0.2, 0.9, 0.1])]
    assert best_of(entries, "max").name == "c4" and best_of(entries, "min").name == "c5"
    assert [e.name for e in retained(entries, 2, "max")] == ["c2", "c4", "c5"]  # c5: the latest
    assert [e.name for e in retained(entries, 2, "min")] == ["c3", "c5"]
    assert best_of([], "max") is None and retained([], 2, "max") == []


def test_incomplete_checkpoint_is_never_loaded(tmp_path):
    broken = tmp_path / "checkpoint_00000099"
    broken.mkdir(parents=True)
    (broken / ckpt.MODEL).write_bytes(b"truncated")
    assert FolderReporter(tmp_path).latest_checkpoint() is None
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.load_model_weights(broken)


def test_tensorboard_has_the_scalars_the_config_and_its_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, "loop.epochs=1", "optim.lr=0.04")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s", "valid/mse"} <= tags
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "    optim:\n      name: adamw\n      lr: 0.04\n" in config
    values, metrics = tensorboard_hparams(tmp_path / "tensorboard")
    assert (values["optim.lr"], values["job.name"], values["data.global_batch_size"]) == (0.04, "tests.toy_job", 8)
    assert metrics == ["valid/mse", "train/loss"]


def test_gradient_clipping_clips_and_reports_the_pre_clip_norm():
    from torch import nn

    from raytpu.runtime import clip_or_measure

    layer = nn.Linear(4, 1)
    layer(torch.ones(2, 4)).sum().mul(100).backward()
    params = list(layer.parameters())
    before = torch.cat([p.grad.flatten() for p in params]).norm()
    norm = clip_or_measure(params, max_norm=1.0)
    torch.testing.assert_close(norm, before)
    after = torch.cat([p.grad.flatten() for p in params]).norm()
    torch.testing.assert_close(after, torch.tensor(1.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(clip_or_measure(params, 0.0), after)


def test_an_epoch_checkpoint_without_an_eval_carries_no_score(tmp_path):
    """eval_every_epochs=2 over 5 epochs: the checkpoints of epochs 1 and 3 have no eval, so they
    report no validation metrics and the worst score (never the previous eval's), never the best."""
    trainer = run(tmp_path, "loop.epochs=5", "loop.eval_every_epochs=2")
    reports = trainer.reporter.reports
    assert ["valid/mse" in r for r in reports] == [False, True, False, True, True]
    assert reports[0]["score"] == reports[2]["score"] == 1e30  # min mode: the worst score
    assert reports[1]["score"] == reports[1]["valid/mse"] and reports[2]["best"] == reports[1]["valid/mse"]


@pytest.mark.parametrize(
    "step, epoch_ended, epochs_done, expected",
    [
        (5, False, 0, (True, True)),
        (4, False, 0, (False, False)),
        (8, True, 1, (False, True)),
        (16, True, 2, (True, True)),
    ],
)
def test_cadence_decides_eval_and_checkpoint_in_one_place(step, epoch_ended, epochs_done, expected):
    from raytpu.worker.cadence import Cadence

    every_5 = Cadence(total_steps=24, every_steps=5, eval_every_epochs=1)
    by_epoch = Cadence(total_steps=24, every_steps=0, eval_every_epochs=2)
    cadence = every_5 if step in (4, 5) else by_epoch
    assert cadence.decide(step, epoch_ended, epochs_done) == expected
    assert by_epoch.decide(24, True, 3) == (True, True)  # the last step always evaluates and checkpoints


class WarmupToyJob(ToyJob):
    """The toy job with a warm-up: evaluations of epoch 0's weights do not count for best."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def eval_step(self, model, batch, ctx):
        self.seen.append((ctx.epoch, ctx.split))
        return super().eval_step(model, batch, ctx)

    def warmup_epochs(self, cfg) -> int:
        return 1


@pytest.mark.parametrize("every_steps", [0, 4])
def test_eval_gets_the_trained_epoch_and_warmup_evals_are_never_best(tmp_path, every_steps):
    """8 steps per epoch, 2 eval batches: ctx.epoch is the epoch whose steps made the weights
    (not the already incremented count at an epoch's end); epoch 0's evals score the worst."""
    cfg, _ = load_config(None, BASE + ["loop.epochs=3", f"checkpoint.every_steps={every_steps}"])
    job = WarmupToyJob()
    reporter = FolderReporter(tmp_path)
    trainer = Trainer(cfg, job, make_runtime("cpu", "auto", 1, 0, 0), tmp_path, tmp_path, reporter)
    trainer.fit()
    evals = [0, 1, 2] if not every_steps else [0, 0, 1, 1, 2, 2]  # every 4 steps: at 4, 8, ..., 24
    assert job.seen == [(epoch, "valid") for epoch in evals for _ in range(2)]
    reports = reporter.reports
    warmup = [r for r, epoch in zip(reports, evals) if epoch == 0]
    counted = [r for r, epoch in zip(reports, evals) if epoch >= 1]
    assert warmup and all(r["score"] == 1e30 and r["best"] == 1e30 for r in warmup)
    assert all(r["score"] == r["valid/mse"] for r in counted)
    assert trainer.progress.best == min(r["valid/mse"] for r in counted) == reports[-1]["best"]

    cfg = with_values(cfg, {"checkpoint.weights": str(reporter.latest_checkpoint())})
    job.seen.clear()
    Trainer(cfg, job, make_runtime("cpu", "auto", 1, 0, 0), tmp_path, tmp_path, FolderReporter(tmp_path)).test()
    assert {split for _, split in job.seen} == {"test"}


def corrupt_truncated_weights(directory: Path) -> None:
    weights = directory / ckpt.MODEL
    weights.write_bytes(weights.read_bytes()[:100])


def corrupt_meta(directory: Path) -> None:
    (directory / ckpt.META).write_text("{not json")


def remove_meta(directory: Path) -> None:
    (directory / ckpt.META).unlink()


@pytest.mark.parametrize("damage", [corrupt_truncated_weights, corrupt_meta, remove_meta])
def test_resume_skips_a_damaged_newest_checkpoint_and_ends_as_an_uninterrupted_run(tmp_path, capsys, damage):
    schedule = ["loop.epochs=3", "checkpoint.every_steps=5", "checkpoint.num_to_keep=3"]
    run(tmp_path / "straight", *schedule)
    with pytest.raises(RuntimeError, match="fault injected"):
        run(tmp_path / "broken", *schedule, "job.fail_at_step=13")
    newest = tmp_path / "broken" / "checkpoint_00000010"
    damage(newest)
    capsys.readouterr()
    resumed = run(tmp_path / "broken", *schedule)
    out = capsys.readouterr().out
    assert f"warning: skipping checkpoint {newest}" in out and "resumed from" in out and "at step 5" in out
    assert resumed.progress.step == 24
    straight, again = final_weights(tmp_path / "straight"), final_weights(tmp_path / "broken")
    for key in straight:
        torch.testing.assert_close(again[key], straight[key], rtol=0, atol=0)


def test_a_full_disk_names_the_path_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """ENOSPC while writing the second checkpoint (the tests run as root, so permissions cannot
    fail): one clear error naming the path; the first checkpoint still loads."""
    import errno

    schedule = ["loop.epochs=2", "checkpoint.every_steps=4"]
    written = {"count": 0}
    real = ckpt.save_weights

    def full_disk(path, state_dict):
        written["count"] += 1
        if written["count"] > 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, state_dict)

    monkeypatch.setattr("raytpu.worker.state.save_weights", full_disk)  # what the checkpointer calls
    with pytest.raises(ckpt.CheckpointWriteError, match="no space left on its disk") as failure:
        run(tmp_path, *schedule)
    assert "model.safetensors" in str(failure.value) and "untouched" in str(failure.value)
    kept = FolderReporter(tmp_path).latest_checkpoint()
    assert kept is not None and kept.name == "checkpoint_00000004"
    assert ckpt.load_model_weights(kept).keys() == final_weights(tmp_path).keys()


class InterruptingReporter(FolderReporter):
    """A reporter that answers ``reason`` when asked at ``step`` (the loop asks at log steps)."""

    def __init__(self, run_dir: Path, reason: str, step: int) -> None:
        super().__init__(run_dir, num_to_keep=5)
        self.reason, self.step, self.asked = reason, step, []

    def interruption(self) -> str | None:
        self.asked.append(len(self.reports))
        return self.reason if len(self.asked) == self.step // 2 else None  # loop.log_every=2


@pytest.mark.parametrize("reason", ["stop", "preempted"])
def test_a_stop_or_a_preemption_checkpoints_the_current_step_never_as_the_best(tmp_path, reason):
    """Asked at step 6 (between the epoch checkpoints at 8 and 16): a checkpoint of step 6 without
    an eval (worst score, never best) whose meta says why; a stop ends the run there, and the
    same run resumed ends with the weights of an uninterrupted one; a preemption trains on."""
    schedule = ["loop.epochs=3"]
    run(tmp_path / "straight", *schedule)
    cfg, job = load_config(None, BASE + schedule)
    reporter = InterruptingReporter(tmp_path / "run", reason, 6)
    trainer = Trainer(cfg, job, make_runtime("cpu", "auto", 1, 0, 0), tmp_path / "run", tmp_path, reporter)
    trainer.fit()
    taken = ckpt.read_meta(reporter.root / "checkpoint_00000006")
    assert taken["reason"] == reason and "valid/mse" not in taken["metrics"]
    assert reporter.reports[0]["step"] == 6 and reporter.reports[0]["score"] == 1e30
    if reason == "stop":
        assert trainer.progress.step == 6 and len(reporter.reports) == 1
        resumed = run(tmp_path / "run", *schedule)
        assert resumed.progress.step == 24
    else:
        assert trainer.progress.step == 24 and [r["step"] for r in reporter.reports] == [6, 8, 16, 24]
    straight, again = final_weights(tmp_path / "straight"), final_weights(tmp_path / "run")
    for key in straight:
        torch.testing.assert_close(again[key], straight[key], rtol=0, atol=0)
