"""IRSTD metrics on hand-built masks whose mIoU, nIoU, Pd and Fa are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raytpu.jobs.mshnet import metrics


def logits_from(*masks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.where(np.stack(masks), 5.0, -5.0)).float()[:, None]


def labels_from(*masks: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack(masks).astype(np.float32))[:, None]


def two_images() -> tuple[list[np.ndarray], list[np.ndarray]]:
    # image 1: a 2x2 target; the prediction covers it plus one touching pixel (inter 4, its union 5)
    #          and a separate 3-pixel false blob: union 8, IoU 1/2, Fa 3 px, Pd 1/1
    truth1 = np.zeros((10, 10), bool)
    truth1[2:4, 2:4] = True
    pred1 = truth1.copy()
    pred1[4, 3] = True
    pred1[8, 6:9] = True
    # image 2: a 1-pixel target found exactly and a 2x2 target missed: inter 1, union 5, IoU 1/5, Pd 1/2
    truth2 = np.zeros((10, 10), bool)
    truth2[1, 1] = truth2[7:9, 7:9] = True
    pred2 = np.zeros((10, 10), bool)
    pred2[1, 1] = True
    return [pred1, pred2], [truth1, truth2]


def test_metrics_on_hand_built_masks():
    preds, truths = two_images()
    totals = metrics.batch_stats(logits_from(*preds), labels_from(*truths))
    assert {k: float(v) for k, v in totals.items()} == {
        "inter": 5.0,
        "union": 13.0,
        "niou_sum": pytest.approx(0.5 + 0.2),
        "images": 2.0,
        "pd_hits": 2.0,
        "pd_targets": 3.0,
        "fa_pixels": 3.0,
        "pixels": 200.0,
    }
    result = metrics.finish(totals)
    assert result["mIoU"] == pytest.approx(100 * 5 / 13)
    assert result["nIoU"] == pytest.approx(100 * (1 / 2 + 1 / 5) / 2)
    assert result["Pd"] == pytest.approx(100 * 2 / 3)
    assert result["Fa"] == pytest.approx(1e6 * 3 / 200)


def test_statistics_are_summable_float64_scalars():
    preds, truths = two_images()
    whole = metrics.batch_stats(logits_from(*preds), labels_from(*truths))
    parts = [metrics.batch_stats(logits_from(p), labels_from(t)) for p, t in zip(preds, truths)]
    for key, value in whole.items():
        assert value.dtype == torch.float64 and value.device.type == "cpu" and value.shape == ()
        assert float(value) == pytest.approx(float(parts[0][key] + parts[1][key]))


def test_centroid_must_be_closer_than_three_pixels():
    truth = np.zeros((20, 20), bool)
    truth[5, 5] = True
    near, far = np.zeros_like(truth), np.zeros_like(truth)
    near[5, 7] = True  # 2 px away: detected
    far[5, 8] = True  # 3 px away: missed, and a false alarm
    assert metrics.match_targets(near, truth) == (1, 1, 0)
    assert metrics.match_targets(far, truth) == (0, 1, 1)


def test_components_are_eight_connected():
    pred = np.zeros((6, 6), bool)
    pred[1, 1] = pred[2, 2] = True  # diagonal neighbours: one component of 2 pixels
    truth = np.zeros_like(pred)
    truth[3, 4] = truth[4, 5] = True  # one target
    assert metrics.match_targets(pred, np.zeros_like(pred)) == (0, 0, 2)
    assert metrics.match_targets(np.zeros_like(pred), truth) == (0, 1, 0)


def test_each_prediction_matches_one_target_in_label_order():
    truth = np.zeros((12, 12), bool)
    truth[5, 5] = truth[5, 8] = True  # two targets 3 px apart
    pred = np.zeros_like(truth)
    pred[5, 6] = True  # 1 px from the first, 2 px from the second: the first takes it
    assert metrics.match_targets(pred, truth) == (1, 2, 0)
    pred[5, 9] = True  # now the second target has its own component
    assert metrics.match_targets(pred, truth) == (2, 2, 0)


def test_legacy_fa_drops_unmatched_components_of_a_matched_area():
    truth = np.zeros((16, 16), bool)
    truth[2, 2:5] = True  # a 3-pixel target
    pred = truth.copy()
    pred[10, 10:13] = True  # unmatched, also 3 pixels: the authors' PD_FA ignores it
    pred[14, 1:3] = True  # unmatched, 2 pixels: counted by both
    assert metrics.match_targets(pred, truth) == (1, 1, 5)
    assert metrics.match_targets(pred, truth, legacy_fa=True) == (1, 1, 2)


def test_empty_image_counts_as_zero_iou_and_threshold_is_zero_logit():
    empty = np.zeros((8, 8), bool)
    stats = metrics.batch_stats(logits_from(empty), labels_from(empty))
    assert float(stats["niou_sum"]) == 0.0 and float(stats["images"]) == 1.0
    truth = np.zeros((8, 8), bool)
    truth[3, 3] = True
    logits = torch.full((1, 1, 8, 8), -0.1)
    logits[0, 0, 3, 3] = 0.1
    assert metrics.finish(metrics.batch_stats(logits, labels_from(truth)))["mIoU"] == pytest.approx(100.0)
