"""The training loop in-process on the cpu runtime (no Ray): resume, accumulation, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raytpu import checkpoint as ckpt
from raytpu.config import ConfigError, load_config
from raytpu.loop import LocalReporter, NonFiniteLossError, Trainer
from raytpu.runtime import make_runtime

BASE = [
    "job.name=tests.toy_job",
    "data.global_batch_size=8",
    "loop.log_every=2",
    "optim.lr=0.05",
    "logging.progress_bar=false",
]


def run(run_dir: Path, *overrides: str) -> Trainer:
    cfg, job = load_config(None, BASE + list(overrides))
    trainer = Trainer(cfg, job, make_runtime("cpu", "auto", 1, 0, 0), run_dir, run_dir, LocalReporter(run_dir))
    trainer.fit()
    return trainer


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = LocalReporter(run_dir).latest_checkpoint()
    assert latest is not None
    return load_file(latest / ckpt.MODEL)


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path):
    schedule = ["loop.epochs=3", "checkpoint.every_steps=5", "optim.scheduler=cosine", "loop.ema_beta=0.9"]
    run(tmp_path / "straight", *schedule)
    with pytest.raises(RuntimeError, match="fault injected"):
        run(tmp_path / "broken", *schedule, "loop.fail_at_step=13")
    assert ckpt.read_meta(LocalReporter(tmp_path / "broken").latest_checkpoint())["step"] == 10
    resumed = run(tmp_path / "broken", *schedule)
    assert resumed.progress.step == 24
    straight, again = final_weights(tmp_path / "straight"), final_weights(tmp_path / "broken")
    for key in straight:
        torch.testing.assert_close(again[key], straight[key], rtol=0, atol=0)


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
    cfg, job = load_config(None, BASE + ["data.global_batch_size=7"])
    runtime = make_runtime("cpu", "auto", 1, 0, 0)
    runtime.world_size = 2
    with pytest.raises(ConfigError, match="not divisible by 2 data-parallel workers"):
        Trainer(cfg, job, runtime, tmp_path, tmp_path, LocalReporter(tmp_path)).fit()


def test_completed_run_is_not_retrained_and_reports_its_end_again(tmp_path):
    first = run(tmp_path, "loop.epochs=2")
    before = final_weights(tmp_path)
    again = run(tmp_path, "loop.epochs=2")
    assert again.progress.step == 16
    torch.testing.assert_close(final_weights(tmp_path)["0.weight"], before["0.weight"])
    # one report, the last one of the first run (counted across runs: report 2, train/loss kept)
    assert again.reporter.reports == [first.reporter.reports[-1]]
    assert [r["report"] for r in first.reporter.reports] == [1, 2]
    assert "train/loss" in again.reporter.reports[0]


def test_checkpoints_are_complete_and_pruned(tmp_path):
    run(tmp_path, "loop.epochs=2", "checkpoint.every_steps=3", "checkpoint.num_to_keep=2")
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["checkpoint_00000015", "checkpoint_00000016"]
    meta = ckpt.read_meta(tmp_path / "checkpoints" / kept[-1])
    assert meta["step"] == 16 and "valid/mse" in meta["metrics"]
    assert (tmp_path / "checkpoints" / kept[-1] / "rng" / "rank_0.pt").is_file()


def test_incomplete_checkpoint_is_never_loaded(tmp_path):
    broken = tmp_path / "checkpoints" / "checkpoint_00000099"
    broken.mkdir(parents=True)
    (broken / ckpt.MODEL).write_bytes(b"truncated")
    assert LocalReporter(tmp_path).latest_checkpoint() is None
    with pytest.raises(ckpt.CheckpointError, match="incomplete"):
        ckpt.load_model_weights(broken)


def test_tensorboard_scalars_are_written(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, "loop.epochs=1")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/samples_per_s", "valid/mse"} <= tags


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
