"""IRSTD evaluation: mIoU, nIoU, Pd and Fa as summable per-batch statistics.

Each batch gives counts that add up over batches and workers; :func:`finish`
turns the totals into the reported numbers (mIoU, nIoU, Pd in percent, Fa x1e-6).
Pd/Fa follow the usual IRSTD protocol: 8-connected components; a true target
is detected when a predicted component's centroid lies within 3 px of its
centroid (each predicted component matches at most one target); Fa counts the
pixels of predicted components that matched nothing.
"""

from __future__ import annotations

import numpy as np
import torch
from skimage import measure

MATCH_DISTANCE = 3.0


def pixel_stats(logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Intersection/union sums and per-image IoU sum (prediction = logits > 0)."""
    pred = (logits > 0).float()
    truth = (target > 0.5).float()
    inter = (pred * truth).sum(dim=(1, 2, 3))
    union = pred.sum(dim=(1, 2, 3)) + truth.sum(dim=(1, 2, 3)) - inter
    per_image = inter / union.clamp(min=1)
    return {
        "inter": inter.sum(),
        "union": union.sum(),
        "niou_sum": per_image.sum(),
        "images": torch.tensor(float(len(pred)), device=logits.device),
    }


def match_targets(pred: np.ndarray, truth: np.ndarray) -> tuple[int, int, int]:
    """For one image: (detected targets, targets, false-alarm pixels)."""
    predicted = measure.regionprops(measure.label(pred, connectivity=2))
    targets = measure.regionprops(measure.label(truth, connectivity=2))
    unmatched = list(predicted)
    detected = 0
    for target in targets:
        centre = np.asarray(target.centroid)
        for index, region in enumerate(unmatched):
            if np.linalg.norm(np.asarray(region.centroid) - centre) < MATCH_DISTANCE:
                detected += 1
                del unmatched[index]
                break
    false_pixels = int(sum(region.area for region in unmatched))
    return detected, len(targets), false_pixels


def detection_stats(logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pd/Fa counts for a batch (runs on the host: connected components)."""
    pred = (logits.detach().float().cpu().numpy() > 0)[:, 0]
    truth = (target.detach().float().cpu().numpy() > 0.5)[:, 0]
    hits = targets = false_pixels = 0
    for image_pred, image_truth in zip(pred, truth):
        found, total, false = match_targets(image_pred, image_truth)
        hits, targets, false_pixels = hits + found, targets + total, false_pixels + false
    return {
        "pd_hits": torch.tensor(float(hits)),
        "pd_targets": torch.tensor(float(targets)),
        "fa_pixels": torch.tensor(float(false_pixels)),
        "pixels": torch.tensor(float(pred.size)),
    }


def batch_stats(logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    stats = {k: v.detach().cpu() for k, v in pixel_stats(logits, target).items()}
    stats.update(detection_stats(logits, target))
    return stats


def finish(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    def ratio(num: str, den: str) -> float:
        return float(totals[num]) / max(float(totals[den]), 1e-12)

    return {
        "mIoU": 100 * ratio("inter", "union"),
        "nIoU": 100 * ratio("niou_sum", "images"),
        "Pd": 100 * ratio("pd_hits", "pd_targets"),
        "Fa": 1e6 * ratio("fa_pixels", "pixels"),
    }
