"""CDEIT job: config and flags, steps, eval reduction, test mode (sampler, metrics, PNGs) on simulated and real data."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import default_collate

from raytpu.config import load_config
from raytpu.job import StepContext
from raytpu.jobs.cdeit import JOB, CDEITConfig, reconstruction_metrics
from raytpu.jobs.cdeit.synth import synthesize

ROOT = Path(__file__).resolve().parents[1]
REAL = Path(os.environ.get("CDEIT_REAL_DATA", ROOT.parent / "shared" / "data" / "cdeit-real"))
TINY = ["job.hidden_size=32", "job.num_heads=4", "job.scales=2", "data.global_batch_size=4"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(tmp_path_factory.mktemp("cdeit-job") / "data", 8, 4, 3, size=32, seed=0, processes=1)


def config(*overrides: str):
    cfg, job = load_config(ROOT / "jobs/cdeit/small.yaml", [*TINY, *overrides])
    assert job is JOB
    return cfg


def test_seed_flags_and_pickling() -> None:
    cfg = config("--data", "uef2017", "--samplingsteps", "3", "--global-batch-size", "8", "--ckpt-every", "100")
    assert isinstance(cfg.job, CDEITConfig) and cfg.job.eval_set == "uef2017" and cfg.job.sampling_steps == 3
    assert cfg.data.global_batch_size == 8 and cfg.checkpoint.every_steps == 100
    assert type(pickle.loads(pickle.dumps(JOB))) is type(JOB)
    full, _ = load_config(ROOT / "jobs/cdeit/paper.yaml", [])
    assert full.loop.ema_beta == 0.995 and full.loop.ema_every == 10 and full.optim.lr == 1e-5


def test_train_and_eval_steps(data_root: Path) -> None:
    cfg = config(f"data.path={data_root}", "job.loss=l1")
    torch.manual_seed(0)
    model = JOB.build_model(cfg)
    batch = default_collate([JOB.build_dataset(cfg, "train", data_root)[i] for i in range(4)])
    ctx = StepContext(epoch=0, step=0, training=True, config=cfg)
    loss, logs = JOB.train_step(model, batch, ctx)
    assert loss.shape == () and logs["loss"] is loss
    loss.backward()
    assert model.final_layer.linear.weight.grad.abs().sum() > 0
    with torch.no_grad():
        stats = JOB.eval_step(model, batch, ctx)
        images = JOB.eval_images(model, batch, ctx)
    totals = {k: v + v for k, v in stats.items()}  # as if summed over two workers
    metrics = JOB.finish_eval(totals)
    assert set(metrics) == {"val_loss", "val_l1", "val_mse"}
    assert metrics["val_l1"] == pytest.approx(float(stats["l1_sum"]) / 4) == metrics["val_loss"]  # job.loss=l1
    assert metrics["val_mse"] == pytest.approx(float(stats["mse_sum"]) / 4)
    mse_ctx = StepContext(epoch=0, step=0, training=False, config=config(f"data.path={data_root}", "job.loss=mse"))
    with torch.no_grad():
        torch.manual_seed(1)
        mse_stats = JOB.eval_step(model, batch, mse_ctx)
    assert mse_stats["loss_sum"] == mse_stats["mse_sum"]
    assert images["truth_tr_prediction"].shape == (4, 1, 32, 96)
    assert float(images["truth_tr_prediction"].min()) >= 0 and float(images["truth_tr_prediction"].max()) <= 1
    assert JOB.main_metric == "val_loss" and JOB.main_metric_mode == "min"


def test_reconstruction_metrics() -> None:
    truth = torch.zeros(2, 1, 4, 4)
    truth[:, :, 0, 0] = 1.0
    prediction = truth.clone()
    prediction[1] += 0.1
    metrics = reconstruction_metrics(truth, prediction)
    assert metrics["rmse"] == pytest.approx(math.sqrt(0.01 / 2))
    psnr_second = 10 * math.log10(1.0 / (0.05**2))
    assert metrics["psnr"] == pytest.approx((10 * math.log10(1e12) + psnr_second) / 2)


def test_test_mode_on_simulated_set(data_root: Path, tmp_path: Path) -> None:
    cfg = config(f"data.path={data_root}", "job.test_images=2")
    model = JOB.build_model(cfg)
    first = JOB.test(model, cfg, tmp_path)
    assert {"rmse", "psnr", "psnr_std", "rmse_image_std", "images"} <= set(first)
    assert first["images"] == 3 and math.isfinite(first["rmse"])
    assert sorted(p.name for p in (tmp_path / "test_simulated").glob("*.png")) == [
        "simulated_0000.png",
        "simulated_0001.png",
    ]
    assert JOB.test(model, cfg, tmp_path / "again") == first  # seeded sampler


def test_a_sharded_model_runs_the_jobs_own_test_on_every_rank(data_root: Path, tmp_path: Path) -> None:
    """CDEIT's test (its sampler) under FSDP2 on 2 gloo workers: every forward of a sharded model is
    a collective, so every rank runs the test (on rank 0 alone it waited forever); rank 0's metrics
    and files are the test's, and they equal the unsharded model's."""
    from raytpu.records.checkpoints import save_weights
    from tests.conftest import start_python

    cfg = config(f"data.path={data_root}", "job.test_images=2")
    torch.manual_seed(0)
    save_weights(tmp_path / "model.safetensors", JOB.build_model(cfg).state_dict())
    words = [*TINY, "job.test_images=2", "--fsdp", "full_shard", f"checkpoint.weights={tmp_path / 'model.safetensors'}"]
    env = {"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    args = ["-m", "tests.sharded_test_worker", str(tmp_path / "run"), str(data_root), *words]
    ranks = [start_python(args, {**env, "RANK": str(rank)}) for rank in range(2)]
    try:
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    sharded = json.loads(outputs[0][0].strip().splitlines()[-1])
    model = JOB.build_model(cfg)
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    whole = JOB.test(model, cfg, tmp_path / "whole")
    assert sharded["test/images"] == whole["images"] == 3
    assert sharded["test/rmse"] == pytest.approx(whole["rmse"], rel=1e-4)
    assert sorted(p.name for p in (tmp_path / "run" / "test_simulated").glob("*.png")) == [
        "simulated_0000.png",
        "simulated_0001.png",
    ]


@pytest.mark.skipif(not (REAL / "uef2017").is_dir(), reason="shared UEF2017 measurements not present")
def test_test_mode_on_real_uef2017(tmp_path: Path) -> None:
    real = ["job.image_size=128", "job.patch_size=4", "--samplingsteps", "1"]  # cheap on CPU at 128x128
    cfg = config("--data", "uef2017", "--data-path", str(REAL), *real, "data.global_batch_size=8")
    metrics = JOB.test(JOB.build_model(cfg), cfg, tmp_path)
    assert metrics["images"] == 22 and math.isfinite(metrics["psnr"])
    assert len(list((tmp_path / "test_uef2017").glob("*.png"))) == 22
