"""The vectorised SLS loss against a per-image reference written from the formula."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from raytpu.jobs.mshnet.loss import mshnet_loss, sls_iou_loss
from raytpu.jobs.mshnet.model import MSHNet

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_sls(logits: torch.Tensor, target: torch.Tensor, warm: bool) -> torch.Tensor:
    """The SLS loss image by image, in float64."""
    ious, scaled, location = [], [], []
    for logit, label in zip(logits.double(), target.double()):
        p = torch.sigmoid(logit)
        inter, pred_area, true_area = float((p * label).sum()), float(p.sum()), float(label.sum())
        iou = inter / (pred_area + true_area - inter)
        d = ((pred_area - true_area) / 2) ** 2
        ious.append(iou)
        scaled.append((min(pred_area, true_area) + d) / (max(pred_area, true_area) + d) * iou)
        h, w = p.shape[-2:]
        xs = torch.arange(w).double().view(1, 1, w) / w
        ys = torch.arange(h).double().view(1, h, 1) / h
        cpx, cpy = float((xs * p).mean()), float((ys * p).mean())
        ctx, cty = float((xs * label).mean()), float((ys * label).mean())
        angle = 4 / math.pi**2 * (math.atan(cpy / (cpx + 1e-8)) - math.atan(cty / (ctx + 1e-8))) ** 2
        lp, lt = math.sqrt(cpx**2 + cpy**2 + 1e-8), math.sqrt(ctx**2 + cty**2 + 1e-8)
        location.append(1 - min(lp, lt) / (max(lp, lt) + 1e-8) + angle)
    if not warm:
        return torch.tensor(1 - sum(ious) / len(ious))
    return torch.tensor(1 - sum(scaled) / len(scaled) + sum(location) / len(location))


def random_batch(seed: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 1, size, size, generator=generator) * 3
    target = (torch.rand(3, 1, size, size, generator=generator) > 0.9).float()
    return logits, target


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_sls_loss_matches_reference(warm, seed):
    logits, target = random_batch(seed)
    expected = reference_sls(logits, target, warm).float()
    torch.testing.assert_close(sls_iou_loss(logits, target, warm), expected, rtol=1e-5, atol=1e-6)


def test_full_loss_averages_fused_output_and_pooled_heads():
    model = MSHNet().eval()
    x = torch.randn(2, 3, 32, 32)
    target = torch.zeros(2, 1, 32, 32)
    target[0, :, 10:13, 20:23] = 1
    target[1, :, 3, 5] = 1
    with torch.no_grad():
        masks, logits = model(x, True)
        _, head0 = model(x, False)
    labels = [target, F.max_pool2d(target, 2), F.max_pool2d(target, 4), F.max_pool2d(target, 8)]
    parts = [reference_sls(logits, target, True)] + [reference_sls(h, lab, True) for h, lab in zip(masks, labels)]
    expected = (sum(parts) / 5).float()
    torch.testing.assert_close(mshnet_loss(masks, logits, target, True), expected, rtol=1e-5, atol=1e-6)
    expected_warmup = reference_sls(head0, target, False).float()
    torch.testing.assert_close(mshnet_loss([], head0, target, False), expected_warmup, rtol=1e-5, atol=1e-6)


def test_loss_is_float32_for_low_precision_logits():
    logits, target = random_batch(2, size=32)
    loss = sls_iou_loss(logits.bfloat16(), target.bfloat16(), True)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, sls_iou_loss(logits.bfloat16().float(), target, True))


def test_gradients_are_finite_and_side_heads_idle_in_warm_up():
    model = MSHNet()
    x, target = torch.randn(2, 3, 32, 32), torch.zeros(2, 1, 32, 32)
    target[0, 0, 5, 5] = 1  # the second image has no target at all
    for warm in (False, True):
        model.zero_grad(set_to_none=True)
        masks, logits = model(x, warm)
        loss = mshnet_loss(masks, logits, target, warm)
        loss.backward()
        assert torch.isfinite(loss)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        for name in ("final", "output_1", "output_2", "output_3"):
            assert (getattr(model, name).weight.grad is not None) == warm, name
