"""The EMA of the weights: ``ema_pytorch``'s warm-up schedule, and what a short run's EMA holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raytpu.config import load_config
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.optim import EMA, EMASchedule
from raytpu.worker.reporting import FolderReporter


def reference_decays(calls: int, beta: float, every: int, after: int, power: float) -> list[float | None]:
    """The decay ``ema_pytorch.EMA.update()`` applies at each call, restated from its documented
    behaviour: a counter of calls; every ``every``-th call updates; up to ``after`` calls it
    copies (decay 0); then decay = clamp(1 - (1 + n)^-power, 0, beta), n = counter - after - 1.
    ``None``: the call does nothing."""
    decays: list[float | None] = []
    for counter in range(calls):
        if counter % every:
            decays.append(None)
        elif counter <= after:
            decays.append(0.0)
        else:
            n = counter - after - 1
            decays.append(0.0 if n <= 0 else min(max(1 - (1 + n) ** -power, 0.0), beta))
    return decays


@pytest.mark.parametrize(("every", "after"), [(10, 100), (1, 0), (3, 7)])
def test_schedule_is_ema_pytorch_s(every: int, after: int) -> None:
    schedule = EMASchedule(beta=0.995, every=every, update_after=after, warmup=True)
    for step, decay in enumerate(reference_decays(3000, 0.995, every, after, 2 / 3)):
        expected = 0.0 if decay is None else 1.0 - decay
        assert schedule.weight(step) == pytest.approx(expected, abs=1e-12), step


def test_without_warmup_the_decay_is_beta_once_copying_ends() -> None:
    schedule = EMASchedule(beta=0.9, every=2, update_after=4, warmup=False)
    assert [round(schedule.weight(step), 6) for step in range(9)] == [1, 0, 1, 0, 1, 0, 0.1, 0, 0.1]


def test_the_ramp_reaches_beta_and_stays() -> None:
    schedule = EMASchedule(beta=0.99, every=1, update_after=0, warmup=True)
    decays = [schedule.decay(step) for step in range(2000)]
    assert decays == sorted(decays) and decays[-1] == 0.99 and decays[50] < 0.99


def test_update_is_a_lerp_with_a_float_or_a_tensor_weight() -> None:
    model = torch.nn.Linear(3, 2)
    ema = EMA(model)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    before = [p.clone() for p in ema.model.parameters()]
    ema.update(model, 0.25)
    for old, new, live in zip(before, ema.model.parameters(), model.parameters()):
        torch.testing.assert_close(new, old + 0.25 * (live - old))
    ema.update(model, torch.tensor(1.0))
    for new, live in zip(ema.model.parameters(), model.parameters()):
        torch.testing.assert_close(new, live)


def run(run_dir: Path, *overrides: str) -> Trainer:
    cfg, job = load_config(
        None,
        ["job.name=tests.toy_job", "data.global_batch_size=8", "logging.progress_bar=false", "loop.epochs=4",
         "optim.lr=0.05", "loop.ema_beta=0.995", "loop.ema_every=2", *overrides],
    )  # fmt: skip
    trainer = Trainer(cfg, job, make_runtime("cpu", "auto", 1, 0, 0), run_dir, run_dir, FolderReporter(run_dir))
    trainer.fit()
    return trainer


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum((a[k] - b[k]).norm() for k in a))


def test_a_short_run_s_ema_follows_its_weights_with_the_warmup(tmp_path: Path) -> None:
    """32 steps: with beta 0.995 at once the EMA still holds ~92% of the initial weights; with
    the warm-up (copies for 10 steps, then a ramping decay) it stays close to the trained ones."""
    distances = {}
    for name, extra in {
        "warmup": ["loop.ema_update_after=10"],
        "beta": ["loop.ema_warmup=false", "loop.ema_update_after=0"],
    }.items():
        trainer = run(tmp_path / name, *extra)
        latest = FolderReporter(tmp_path / name).latest_checkpoint()
        weights, ema = load_file(latest / ckpt.MODEL), load_file(latest / ckpt.EMA)
        torch.manual_seed(trainer.cfg.run.seed * 1000)  # as the trainer seeds rank 0 before building
        initial = {k: v.detach() for k, v in trainer.job.build_model(trainer.cfg).state_dict().items()}
        assert trainer.progress.step == 32
        distances[name] = distance(ema, weights) / distance(initial, weights)
    assert distances["warmup"] < 0.5 < distances["beta"], distances
