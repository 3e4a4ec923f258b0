"""The MSHNet job through the Job interface the library calls: config, datasets, steps, pickling."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

import raytpu.jobs.mshnet as mshnet
from raytpu.config import load_config
from raytpu.job import StepContext, in_warmup, load_job
from raytpu.jobs.mshnet import metrics

SMALL_WIDTHS = [8, 8, 16, 16, 32]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    job = mshnet.MSHNetConfig(base_size=32, crop_size=32, warm_epoch=2, widths=SMALL_WIDTHS, synth_n=10, synth_size=48)
    config = SimpleNamespace(job=job, run=SimpleNamespace(seed=0))
    config.root = tmp_path_factory.mktemp("mshnet")
    mshnet.JOB.synthesize(config.root, **mshnet.JOB.synth_options(config))
    return config


def batch_of(cfg, split: str, size: int = 2) -> dict[str, torch.Tensor]:
    dataset = mshnet.JOB.build_dataset(cfg, split, cfg.root)
    items = [dataset[i] for i in range(size)]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def test_job_is_registered_and_picklable():
    job = load_job("mshnet")
    assert job is mshnet.JOB and isinstance(pickle.loads(pickle.dumps(job)), mshnet.MSHNetJob)
    assert (job.main_metric, job.main_metric_mode) == ("mIoU", "max")
    assert job.config_class is mshnet.MSHNetConfig


def test_seed_script_flags_set_the_config():
    flags = ["--dataset-dir", "/d", "--batch-size", "8", "--epochs", "3", "--lr", "0.1", "--warm-epoch", "1"]
    flags += ["--base-size", "64", "--crop-size", "48", "--weight-path", "w.pt"]
    config, job = load_config("jobs/mshnet/irstd1k.yaml", flags)
    assert job is mshnet.JOB and isinstance(config.job, mshnet.MSHNetConfig)
    assert (config.data.path, config.data.global_batch_size, config.loop.epochs, config.optim.lr) == ("/d", 8, 3, 0.1)
    assert (config.job.warm_epoch, config.job.base_size, config.job.crop_size) == (1, 64, 48)
    assert config.checkpoint.weights == "w.pt"


def test_model_and_datasets(cfg):
    default = SimpleNamespace(job=mshnet.MSHNetConfig())
    assert sum(p.numel() for p in mshnet.JOB.build_model(default).parameters()) == 4_065_513
    with pytest.raises(ValueError, match="multiples of 16"):
        mshnet.JOB.check_config(SimpleNamespace(job=mshnet.MSHNetConfig(crop_size=40)))
    shallow = mshnet.JOB.build_model(SimpleNamespace(job=mshnet.MSHNetConfig(blocks=1)))
    assert (len(shallow.encoder_1), len(shallow.decoder_1), len(shallow.encoder_0)) == (1, 1, 1)
    assert len(mshnet.JOB.build_model(default).encoder_1) == 2
    with pytest.raises(ValueError, match="job.blocks must be at least 1, got 0"):
        mshnet.JOB.check_config(SimpleNamespace(job=mshnet.MSHNetConfig(blocks=0)))
    lengths = {split: len(mshnet.JOB.build_dataset(cfg, split, cfg.root)) for split in ("train", "valid", "test")}
    assert lengths == {"train": 8, "valid": 2, "test": 2}
    assert mshnet.JOB.build_dataset(cfg, "train", cfg.root).augment
    assert not mshnet.JOB.build_dataset(cfg, "valid", cfg.root).augment
    with pytest.raises(ValueError, match="unknown split"):
        mshnet.JOB.build_dataset(cfg, "dev", cfg.root)


def test_train_step_switches_phase_after_warm_epoch(cfg):
    """As the authors' main.py: epochs 0..warm_epoch (here 0, 1, 2) train the level-0 head only."""
    model = mshnet.JOB.build_model(cfg)
    batch = batch_of(cfg, "train")
    for epoch, warm in ((0, False), (2, False), (3, True)):
        model.zero_grad(set_to_none=True)
        loss, extra = mshnet.JOB.train_step(model, batch, StepContext(epoch, 0, True, cfg))
        loss.backward()
        assert loss.shape == () and torch.isfinite(loss) and extra["loss"] is loss
        assert (model.final.weight.grad is not None) == warm
        assert (model.output_1.weight.grad is not None) == warm


class FlagRecorder(torch.nn.Module):
    """Wraps the model and records the ``warm_flag`` of every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model, self.flags = model, []

    def forward(self, x, warm_flag=True):
        self.flags.append(warm_flag)
        return self.model(x, warm_flag)


def test_eval_scores_the_trained_head_and_only_post_warmup_evals_count_for_best(cfg):
    """An eval after epoch e scores the level-0 head while e <= warm_epoch (2), the fused
    output after; the test split always scores the fused output."""
    model = FlagRecorder(mshnet.JOB.build_model(cfg).eval())
    batch = batch_of(cfg, "valid")
    cases = [(0, "valid", False), (2, "valid", False), (3, "valid", True), (0, "test", True), (9, "test", True)]
    with torch.no_grad():
        for epoch, split, fused in cases:
            ctx = StepContext(epoch, 0, False, cfg, split=split)
            model.flags.clear()
            stats = mshnet.JOB.eval_step(model, batch, ctx)
            images = mshnet.JOB.eval_images(model, batch, ctx)
            assert model.flags == [fused, fused], (epoch, split)
            _, logits = model.model(batch["image"], fused)
            expected = metrics.batch_stats(logits, batch["mask"])
            assert {k: float(v) for k, v in stats.items()} == {k: float(v) for k, v in expected.items()}
            torch.testing.assert_close(images["prediction"], torch.sigmoid(logits))
    assert [in_warmup(mshnet.JOB, cfg, epoch) for epoch in range(5)] == [True, True, True, False, False]


def test_fusion_init_level0_passes_the_level0_head_through(cfg):
    job_cfg = SimpleNamespace(job=mshnet.MSHNetConfig(widths=SMALL_WIDTHS, fusion_init="level0"))
    model = mshnet.JOB.build_model(job_cfg).eval()
    default = mshnet.JOB.build_model(SimpleNamespace(job=mshnet.MSHNetConfig(widths=SMALL_WIDTHS)))
    assert list(model.state_dict()) == list(default.state_dict())  # the authors' names: strict loading still works
    image = batch_of(cfg, "valid")["image"]
    with torch.no_grad():
        (level0, *_), fused = model(image, True)
        _, warm_up = model(image, False)
    torch.testing.assert_close(fused, level0)
    torch.testing.assert_close(fused, warm_up)
    assert not torch.equal(default.final.weight, model.final.weight)
    with pytest.raises(ValueError, match="fusion_init"):
        mshnet.JOB.check_config(SimpleNamespace(job=mshnet.MSHNetConfig(fusion_init="zeros")))


def test_eval_step_images_and_finish(cfg):
    model = mshnet.JOB.build_model(cfg).eval()
    batch = batch_of(cfg, "valid")
    ctx = StepContext(0, 0, False, cfg)
    with torch.no_grad():
        stats = mshnet.JOB.eval_step(model, batch, ctx)
        images = mshnet.JOB.eval_images(model, batch, ctx)
    assert set(stats) == {"inter", "union", "niou_sum", "images", "pd_hits", "pd_targets", "fa_pixels", "pixels"}
    assert float(stats["pixels"]) == 2 * 32 * 32 and float(stats["images"]) == 2
    assert set(mshnet.JOB.finish_eval(stats)) == {"mIoU", "nIoU", "Pd", "Fa"}
    assert set(images) == {"input", "label", "prediction"}
    for image in images.values():
        assert image.shape == (2, 1, 32, 32) and float(image.min()) >= 0 and float(image.max()) <= 1
