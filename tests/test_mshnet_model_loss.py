"""MSHNet model shapes/parameters and the SLS loss against a direct per-image reference."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from jobs.mshnet.loss import mshnet_loss, sls_iou_loss
from jobs.mshnet.model import MSHNet


def test_parameter_count_and_original_names():
    model = MSHNet()
    assert sum(p.numel() for p in model.parameters()) == 4_065_513
    keys = model.state_dict().keys()
    for key in (
        "conv_init.weight",
        "encoder_0.0.ca.fc1.weight",
        "encoder_1.0.shortcut.0.weight",
        "encoder_1.1.sa.conv1.weight",
        "middle_layer.1.bn2.running_var",
        "decoder_0.0.shortcut.1.bias",
        "output_3.bias",
        "final.weight",
    ):
        assert key in keys
    assert "encoder_0.0.shortcut.0.weight" not in keys  # same width: identity shortcut
    assert tuple(model.state_dict()["final.weight"].shape) == (1, 4, 3, 3)


def test_output_shapes_in_both_phases():
    model = MSHNet().eval()
    x = torch.randn(2, 3, 64, 64)
    side, logits = model(x, True)
    assert [tuple(h.shape) for h in side] == [(2, 1, 64, 64), (2, 1, 32, 32), (2, 1, 16, 16), (2, 1, 8, 8)]
    assert tuple(logits.shape) == (2, 1, 64, 64)
    warm_head0 = side[0]
    side, logits = model(x, False)
    assert side == [] and tuple(logits.shape) == (2, 1, 64, 64)
    torch.testing.assert_close(logits, warm_head0)  # warm-up returns the level-0 head alone


def reference_sls(logits: torch.Tensor, target: torch.Tensor, warm: bool) -> torch.Tensor:
    """The loss written image by image, straight from the formula."""
    losses_iou, losses_scaled, loc = [], [], []
    for pred_logit, label in zip(logits, target):
        p = torch.sigmoid(pred_logit)
        inter, pred_area, true_area = (p * label).sum(), p.sum(), label.sum()
        iou = inter / (pred_area + true_area - inter)
        d = ((pred_area - true_area) / 2) ** 2
        a = (min(pred_area, true_area) + d) / (max(pred_area, true_area) + d)
        losses_iou.append(iou)
        losses_scaled.append(a * iou)
        h, w = p.shape[-2:]
        xs = torch.arange(w).float().view(1, 1, w) / w
        ys = torch.arange(h).float().view(1, h, 1) / h
        cpx, cpy = (xs * p).mean(), (ys * p).mean()
        ctx, cty = (xs * label).mean(), (ys * label).mean()
        angle = 4 / math.pi**2 * (math.atan(cpy / (cpx + 1e-8)) - math.atan(cty / (ctx + 1e-8))) ** 2
        lp, lt = math.sqrt(cpx**2 + cpy**2 + 1e-8), math.sqrt(ctx**2 + cty**2 + 1e-8)
        loc.append(1 - min(lp, lt) / (max(lp, lt) + 1e-8) + angle)
    if not warm:
        return 1 - torch.stack(losses_iou).mean()
    return 1 - torch.stack(losses_scaled).mean() + sum(loc) / len(loc)


@pytest.mark.parametrize("warm", [False, True])
def test_vectorised_sls_loss_matches_reference(warm):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 1, 16, 16, generator=generator) * 3
    target = (torch.rand(3, 1, 16, 16, generator=generator) > 0.9).float()
    expected = reference_sls(logits, target, warm)
    torch.testing.assert_close(sls_iou_loss(logits, target, warm), expected, rtol=1e-5, atol=1e-6)


def test_full_loss_averages_fused_output_and_heads():
    model = MSHNet().eval()
    x = torch.randn(2, 3, 32, 32)
    target = torch.zeros(2, 1, 32, 32)
    target[:, :, 10:13, 20:23] = 1
    side, logits = model(x, True)
    labels = [target, F.max_pool2d(target, 2), F.max_pool2d(target, 4), F.max_pool2d(target, 8)]
    expected = (
        reference_sls(logits, target, True) + sum(reference_sls(h, lab, True) for h, lab in zip(side, labels))
    ) / 5
    torch.testing.assert_close(mshnet_loss(side, logits, target, True), expected, rtol=1e-5, atol=1e-6)
    _, head0 = model(x, False)
    torch.testing.assert_close(mshnet_loss([], head0, target, False), reference_sls(head0, target, False))


def test_loss_gradients_are_finite_in_both_phases():
    model = MSHNet()
    x, target = torch.randn(2, 3, 32, 32), torch.zeros(2, 1, 32, 32)
    target[0, 0, 5, 5] = 1
    for warm in (False, True):
        model.zero_grad()
        side, logits = model(x, warm)
        mshnet_loss(side, logits, target, warm).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert (model.final.weight.grad is not None) == warm


def test_matmul_upsampling_equals_bilinear_align_corners():
    from jobs.mshnet.model import upsample

    x = torch.randn(2, 3, 5, 7)
    for factor in (2, 4, 8):
        expected = F.interpolate(x, scale_factor=factor, mode="bilinear", align_corners=True)
        torch.testing.assert_close(upsample(x, factor), expected, rtol=1e-5, atol=1e-5)
