"""IRSTD evaluation: mIoU, nIoU, Pd and Fa as summable per-batch statistics.

Each batch gives counts (CPU float64, exact for any realistic data set) that add
up over batches and workers; :func:`finish` turns the totals into the reported
numbers: mIoU and nIoU in percent (x1e-2), Pd in percent, Fa x1e-6.

- prediction = logits > 0 (sigmoid > 0.5), label = mask > 0.5;
- mIoU = sum(intersection) / sum(union) over the whole data set;
- nIoU = mean over images of intersection / union (an image with neither a
  target nor a prediction counts as IoU 0, like the usual IRSTD code);
- Pd/Fa as the authors' ``PD_FA`` at threshold 0: 8-connected components; the
  true targets are visited in label order and each takes the first still
  unmatched predicted component whose centroid lies less than 3 px from its
  own; Pd = matched targets / targets, Fa = pixels of the predicted components
  left unmatched / all pixels. The authors' code also drops unmatched
  components whose *area* equals that of any matched one, which undercounts
  false alarms; here every unmatched component counts unless ``legacy_fa``
  asks for the authors' counting (to compare with the paper's Fa).
"""

from __future__ import annotations

import numpy as np
import torch
from skimage import measure

MATCH_DISTANCE = 3.0


def pixel_stats(logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Intersection/union sums and the per-image IoU sum of a batch, on the logits' device."""
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


def match_targets(pred: np.ndarray, truth: np.ndarray, legacy_fa: bool = False) -> tuple[int, int, int]:
    """For one (H, W) boolean image pair: (detected targets, targets, false-alarm pixels)."""
    unmatched = measure.regionprops(measure.label(pred, connectivity=2))
    matched_areas = set()
    targets = measure.regionprops(measure.label(truth, connectivity=2))
    detected = 0
    for target in targets:
        centre = np.asarray(target.centroid)
        for index, region in enumerate(unmatched):
            if np.linalg.norm(np.asarray(region.centroid) - centre) < MATCH_DISTANCE:
                detected += 1
                matched_areas.add(region.area)
                del unmatched[index]
                break
    if legacy_fa:
        unmatched = [region for region in unmatched if region.area not in matched_areas]
    false_pixels = int(sum(region.area for region in unmatched))
    return detected, len(targets), false_pixels


def detection_stats(logits: torch.Tensor, target: torch.Tensor, legacy_fa: bool = False) -> dict[str, torch.Tensor]:
    """Pd/Fa counts of a batch (on the host: connected components are a NumPy/scikit-image job)."""
    pred = (logits.detach().float().cpu().numpy() > 0)[:, 0]
    truth = (target.detach().float().cpu().numpy() > 0.5)[:, 0]
    counts = np.zeros(3, dtype=np.int64)
    for image_pred, image_truth in zip(pred, truth):
        counts += match_targets(image_pred, image_truth, legacy_fa)
    hits, targets, false_pixels = (torch.tensor(float(c), dtype=torch.float64) for c in counts)
    return {
        "pd_hits": hits,
        "pd_targets": targets,
        "fa_pixels": false_pixels,
        "pixels": torch.tensor(float(pred.size), dtype=torch.float64),
    }


def batch_stats(logits: torch.Tensor, target: torch.Tensor, legacy_fa: bool = False) -> dict[str, torch.Tensor]:
    """All summable statistics of a batch of (N, 1, H, W) logits and labels, as CPU float64 scalars."""
    stats = {k: v.detach().to("cpu", torch.float64) for k, v in pixel_stats(logits, target).items()}
    stats.update(detection_stats(logits, target, legacy_fa))
    return stats


def finish(totals: dict[str, torch.Tensor]) -> dict[str, float]:
    """Summed statistics -> ``mIoU``, ``nIoU``, ``Pd`` (percent) and ``Fa`` (x1e-6)."""

    def ratio(num: str, den: str) -> float:
        return float(totals[num]) / max(float(totals[den]), 1e-12)

    return {
        "mIoU": 100 * ratio("inter", "union"),
        "nIoU": 100 * ratio("niou_sum", "images"),
        "Pd": 100 * ratio("pd_hits", "pd_targets"),
        "Fa": 1e6 * ratio("fa_pixels", "pixels"),
    }
