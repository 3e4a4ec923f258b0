"""The scale- and location-sensitive (SLS) IoU loss of MSHNet, vectorised over the batch.

Per image, with p = sigmoid(logits) and g the label: soft IoU = I / (P + G - I)
weighted by the scale factor (min(P, G) + d) / (max(P, G) + d), d = ((P - G) / 2)^2,
plus a location term comparing the polar coordinates of the predicted and true
"centres". No Python loop over images and no host reads, so it traces to one
static graph on XLA. It is computed in float32 whatever the autocast dtype of
the logits: sums over a whole image in bfloat16 would lose most of their digits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

EPS = 1e-8


def soft_counts(prob: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-image soft intersection, prediction and label areas, each (N,)."""
    dims = (1, 2, 3)
    return (prob * target).sum(dims), prob.sum(dims), target.sum(dims)


def centres(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over pixels of (x/W) m and (y/H) m, per image: (N,), (N,)."""
    height, width = mask.shape[-2:]
    xs = torch.arange(width, device=mask.device, dtype=mask.dtype) / width
    ys = torch.arange(height, device=mask.device, dtype=mask.dtype) / height
    plane = mask.sum(dim=1)  # (N, H, W); masks have one channel
    return (plane * xs).mean(dim=(1, 2)), (plane * ys[:, None]).mean(dim=(1, 2))


def location_loss(prob: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Batch mean of 1 - min/max of the centres' distances to the origin plus the scaled squared angle difference."""
    px, py = centres(prob)
    tx, ty = centres(target)
    angle = (4 / math.pi**2) * (torch.atan(py / (px + EPS)) - torch.atan(ty / (tx + EPS))).square()
    pred_length = torch.sqrt(px * px + py * py + EPS)
    true_length = torch.sqrt(tx * tx + ty * ty + EPS)
    length = torch.minimum(pred_length, true_length) / (torch.maximum(pred_length, true_length) + EPS)
    return (1 - length + angle).mean()


def sls_iou_loss(logits: torch.Tensor, target: torch.Tensor, warm: bool) -> torch.Tensor:
    """SLS loss of one (N, 1, H, W) output. Before warm-up (``warm=False``): 1 - mean soft IoU."""
    prob = torch.sigmoid(logits.float())
    target = target.float()
    inter, pred_area, true_area = soft_counts(prob, target)
    iou = inter / (pred_area + true_area - inter + EPS)
    if not warm:
        return 1 - iou.mean()
    spread = ((pred_area - true_area) / 2).square()
    scale = (torch.minimum(pred_area, true_area) + spread) / (torch.maximum(pred_area, true_area) + spread + EPS)
    return 1 - (scale * iou).mean() + location_loss(prob, target)


def mshnet_loss(
    side_logits: list[torch.Tensor], logits: torch.Tensor, target: torch.Tensor, warm: bool
) -> torch.Tensor:
    """The training loss of one batch from the model's ``(masks, output)``.

    Average of the SLS loss over the fused output and every side head, the
    label max-pooled by 2 for each coarser head. In warm-up the model returns
    no side heads, so this is 1 - mean soft IoU of the level-0 output alone.
    """
    total = sls_iou_loss(logits, target, warm)
    label = target
    for level, head in enumerate(side_logits):
        if level > 0:
            label = F.max_pool2d(label, 2)
        total = total + sls_iou_loss(head, label, warm)
    return total / (len(side_logits) + 1)
