"""MSHNet: a U-Net of attention residual blocks with multi-scale heads.

Parameter names follow the authors' implementation (``encoder_0.0.conv1.weight``,
``output_3.bias``, ``final.weight`` ...), so their released weights load with
``strict=True``. The model knows nothing of devices or parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class ChannelAttention(nn.Module):
    """Squeeze-excitation over average- and max-pooled features (shared MLP)."""

    def __init__(self, channels: int, reduction: int = 16) -> None:
        super().__init__()
        hidden = max(channels // reduction, 1)
        self.fc1 = nn.Conv2d(channels, hidden, 1, bias=False)
        self.fc2 = nn.Conv2d(hidden, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def mlp(pooled: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.relu(self.fc1(pooled)))

        return torch.sigmoid(mlp(F.adaptive_avg_pool2d(x, 1)) + mlp(F.adaptive_max_pool2d(x, 1)))


class SpatialAttention(nn.Module):
    """A 7x7 convolution over the channel-wise mean and max maps."""

    def __init__(self, kernel_size: int = 7) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 1, kernel_size, padding=kernel_size // 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stats = torch.cat([x.mean(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)], dim=1)
        return torch.sigmoid(self.conv1(stats))


class AttentionResidualBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN, channel then spatial attention, residual add, ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(in_channels, out_channels, 1), nn.BatchNorm2d(out_channels))
            if in_channels != out_channels
            else None
        )
        self.ca = ChannelAttention(out_channels)
        self.sa = SpatialAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.shortcut is None else self.shortcut(x)
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        out = self.ca(out) * out
        out = self.sa(out) * out
        return F.relu(out + residual)


def stage(in_channels: int, out_channels: int, blocks: int) -> nn.Sequential:
    """``blocks`` attention residual blocks; only the first changes the width."""
    layers = [AttentionResidualBlock(in_channels, out_channels)]
    layers += [AttentionResidualBlock(out_channels, out_channels) for _ in range(blocks - 1)]
    return nn.Sequential(*layers)


def interpolation_matrix(size_in: int, size_out: int, like: torch.Tensor) -> torch.Tensor:
    """(size_out, size_in) weights of 1-D linear interpolation with ``align_corners=True``.

    Built in float32 and only then cast to ``like``'s dtype: in bfloat16 the
    positions themselves (integers above 256) would already be off by a pixel.
    """
    scale = (size_in - 1) / max(size_out - 1, 1)
    positions = torch.arange(size_out, device=like.device, dtype=torch.float32) * scale
    sources = torch.arange(size_in, device=like.device, dtype=torch.float32)
    weights = (1 - (positions[:, None] - sources[None, :]).abs()).clamp(min=0)
    return weights.to(like.dtype)


def upsample(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Bilinear upsampling (``align_corners=True``), written as two matmuls.

    Same values as ``F.interpolate(..., mode="bilinear", align_corners=True)``,
    but its backward is a matmul everywhere: torch_xla lowers the backward of
    ``upsample_bilinear2d`` only on TPU and falls back to the CPU elsewhere.
    """
    height, width = x.shape[-2:]
    rows = interpolation_matrix(height, height * factor, x)
    cols = interpolation_matrix(width, width * factor, x)
    return rows @ x @ cols.T


class MSHNet(nn.Module):
    """Input (N, C, H, W) with H, W multiples of 16; outputs 1-channel logits.

    ``forward(x, warm_flag)`` returns ``(side_logits, logits)``. With
    ``warm_flag`` the four decoder heads (full, 1/2, 1/4, 1/8 resolution) are
    fused by a 3x3 conv; without it (SLS warm-up) only the level-0 head runs
    and ``side_logits`` is empty.
    """

    def __init__(
        self, input_channels: int = 3, widths: Sequence[int] = (16, 32, 64, 128, 256), blocks: int = 2
    ) -> None:
        super().__init__()
        if len(widths) != 5:
            raise ValueError(f"MSHNet needs 5 widths (encoder levels 0-3 and the middle), got {list(widths)}")
        w0, w1, w2, w3, w4 = widths
        self.conv_init = nn.Conv2d(input_channels, w0, 1)
        self.encoder_0 = stage(w0, w0, 1)
        self.encoder_1 = stage(w0, w1, blocks)
        self.encoder_2 = stage(w1, w2, blocks)
        self.encoder_3 = stage(w2, w3, blocks)
        self.middle_layer = stage(w3, w4, blocks)
        self.decoder_3 = stage(w3 + w4, w3, blocks)
        self.decoder_2 = stage(w2 + w3, w2, blocks)
        self.decoder_1 = stage(w1 + w2, w1, blocks)
        self.decoder_0 = stage(w0 + w1, w0, 1)
        self.output_0 = nn.Conv2d(w0, 1, 1)
        self.output_1 = nn.Conv2d(w1, 1, 1)
        self.output_2 = nn.Conv2d(w2, 1, 1)
        self.output_3 = nn.Conv2d(w3, 1, 1)
        self.final = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, warm_flag: bool = True) -> tuple[list[torch.Tensor], torch.Tensor]:
        e0 = self.encoder_0(self.conv_init(x))
        e1 = self.encoder_1(F.max_pool2d(e0, 2))
        e2 = self.encoder_2(F.max_pool2d(e1, 2))
        e3 = self.encoder_3(F.max_pool2d(e2, 2))
        middle = self.middle_layer(F.max_pool2d(e3, 2))
        d3 = self.decoder_3(torch.cat([e3, upsample(middle, 2)], 1))
        d2 = self.decoder_2(torch.cat([e2, upsample(d3, 2)], 1))
        d1 = self.decoder_1(torch.cat([e1, upsample(d2, 2)], 1))
        d0 = self.decoder_0(torch.cat([e0, upsample(d1, 2)], 1))
        if not warm_flag:
            return [], self.output_0(d0)
        heads = [self.output_0(d0), self.output_1(d1), self.output_2(d2), self.output_3(d3)]
        fused = torch.cat([heads[0], upsample(heads[1], 2), upsample(heads[2], 4), upsample(heads[3], 8)], dim=1)
        return heads, self.final(fused)


def init_fusion_as_level0(model: MSHNet) -> None:
    """Make the fusion conv ``final`` pass the level-0 head through unchanged.

    Its 3x3 kernel becomes the identity on channel 0 and zero on the three
    upsampled coarser heads, its bias zero: at the end of the warm-up (which
    trains only the level-0 head) the fused output starts equal to the trained
    head instead of a random mix of logits of magnitude 10-40. The coarser heads
    still get gradients through the zero weights, so the fusion learns to use them.
    """
    kernel = model.final.weight
    with torch.no_grad():
        kernel.zero_()
        kernel[0, 0, kernel.shape[2] // 2, kernel.shape[3] // 2] = 1.0
        model.final.bias.zero_()
