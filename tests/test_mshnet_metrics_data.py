"""MSHNet metrics on hand-built masks, the synthetic IRSTD layout and the dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jobs.mshnet import metrics
from jobs.mshnet.data import IRSTDDataset
from jobs.mshnet.synth import synthesize


def logits_from(mask: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.where(mask, 5.0, -5.0)).float()[None, None]


def label_from(mask: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(mask.astype(np.float32))[None, None]


def test_metrics_on_hand_built_masks():
    # image 1: target 2x2 at (2,2); prediction covers it plus one extra pixel -> inter 4, union 5
    #          plus a far false blob of 3 pixels -> union 8 in all, Fa 3 px
    truth1 = np.zeros((10, 10), bool)
    truth1[2:4, 2:4] = True
    pred1 = truth1.copy()
    pred1[4, 3] = True
    pred1[8, 6:9] = True
    # image 2: two targets, one found (exact), one missed; no false alarm
    truth2 = np.zeros((10, 10), bool)
    truth2[1, 1] = truth2[7:9, 7:9] = True
    pred2 = np.zeros((10, 10), bool)
    pred2[1, 1] = True
    totals = {}
    for pred, truth in ((pred1, truth1), (pred2, truth2)):
        for key, value in metrics.batch_stats(logits_from(pred), label_from(truth)).items():
            totals[key] = totals.get(key, 0) + value
    result = metrics.finish(totals)
    # inter: 4 + 1 = 5; union: 8 + 5 = 13
    assert result["mIoU"] == pytest.approx(100 * 5 / 13)
    assert result["nIoU"] == pytest.approx(100 * (4 / 8 + 1 / 5) / 2)
    assert result["Pd"] == pytest.approx(100 * 2 / 3)
    assert result["Fa"] == pytest.approx(1e6 * 3 / 200)


def test_centroid_match_needs_less_than_three_pixels():
    truth = np.zeros((20, 20), bool)
    truth[5, 5] = True
    near, far = np.zeros_like(truth), np.zeros_like(truth)
    near[5, 7] = True  # 2 px away
    far[5, 8] = True  # 3 px away: not detected, a false alarm
    assert metrics.match_targets(near, truth) == (1, 1, 0)
    assert metrics.match_targets(far, truth) == (0, 1, 1)


def test_diagonal_neighbours_are_one_component():
    pred = np.zeros((6, 6), bool)
    pred[1, 1] = pred[2, 2] = True  # 8-connected
    truth = np.zeros_like(pred)
    assert metrics.match_targets(pred, truth) == (0, 0, 2)


def test_synthetic_layout_and_determinism(tmp_path):
    synthesize(tmp_path / "a", n=20, size=32, seed=3)
    synthesize(tmp_path / "b", n=20, size=32, seed=3)
    root = tmp_path / "a"
    train = (root / "trainval.txt").read_text().split()
    test = (root / "test.txt").read_text().split()
    assert len(train) == 16 and len(test) == 4 and not set(train) & set(test)
    for name in train + test:
        for folder in ("images", "masks"):
            first, second = root / folder / f"{name}.png", tmp_path / "b" / folder / f"{name}.png"
            assert first.read_bytes() == second.read_bytes()
    sample = IRSTDDataset(root, "test", 32, 32, augment=False)[0]
    assert set(np.unique(sample["mask"].numpy())) <= {0.0, 1.0} and sample["mask"].sum() > 0


def test_dataset_items_and_pure_augmentation(tmp_path):
    synthesize(tmp_path, n=10, size=48, seed=0)
    train = IRSTDDataset(tmp_path, "train", base_size=32, crop_size=32, seed=7)
    item = train[0]
    assert item["image"].shape == (3, 32, 32) and item["image"].dtype == torch.float32
    assert item["mask"].shape == (1, 32, 32)
    again = IRSTDDataset(tmp_path, "train", base_size=32, crop_size=32, seed=7)[0]
    torch.testing.assert_close(item["image"], again["image"])
    train.set_epoch(1)
    assert not torch.equal(train[0]["image"], item["image"])
    test = IRSTDDataset(tmp_path, "test", base_size=64, crop_size=32, augment=False)
    assert test[0]["image"].shape == (3, 64, 64)


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="raytpu data synth mshnet"):
        IRSTDDataset(tmp_path / "nowhere", "train", 32, 32)
