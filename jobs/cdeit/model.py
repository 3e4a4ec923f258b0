"""CDEIT denoiser: a DiT-style U-shaped transformer (Shi et al., CDEIT, ``models.py`` class ``DiT``).

The module tree and parameter names follow the authors' model so that their
checkpoints load with ``strict=True``: ``x_embedder``, ``t_embedder``,
``pos_embed``, ``blocks`` (the U-Net of adaLN-Zero blocks: ``swinIn*``,
``downs``, ``mid``, ``ups``, ``swinOut*``) and ``final_layer``.

Shapes are static and there is no Python branching on tensor values, so the
model traces under XLA. Nothing here knows about devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

EIM_SIZE = 16  # the condition is a 16x16 electrode-pair matrix


@dataclass(frozen=True)
class DiTConfig:
    """Architecture settings. The defaults are the authors' model (109,719,108 parameters)."""

    image_size: int = 128
    patch_size: int = 2
    in_channels: int = 2  # noisy image + upsampled condition
    out_channels: int = 1
    hidden_size: int = 512
    num_heads: int = 16
    window_size: int = 0  # 0: a quarter of the token grid, as the original
    scales: int = 4  # down (and up) stages
    stage_depth: int = 2  # blocks per down / up stage
    window_depth: int = 2  # windowed-attention blocks before and after the U
    mlp_ratio: float = 4.0

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def window(self) -> int:
        return self.window_size or self.grid // 4

    def validate(self) -> None:
        if self.image_size % EIM_SIZE:
            raise ValueError(f"image_size must be a multiple of {EIM_SIZE}, got {self.image_size}")
        if self.grid % (2**self.scales):
            raise ValueError(f"token grid {self.grid} must be divisible by 2**scales = {2**self.scales}")
        if self.hidden_size % self.num_heads or self.hidden_size % 4:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads and by 4")
        if self.window < self.grid and self.grid % self.window:
            raise ValueError(f"window_size {self.window} must divide the token grid {self.grid}")


SMALL = DiTConfig(image_size=32, hidden_size=64)


# ------------------------------------------------------------------ helpers
def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def nearest_upsample(x: torch.Tensor, factor: int) -> torch.Tensor:
    """Nearest-neighbour upsampling of (N, C, H, W) by an integer factor, as views (XLA friendly)."""
    n, c, h, w = x.shape
    return x[:, :, :, None, :, None].expand(n, c, h, factor, w, factor).reshape(n, c, h * factor, w * factor)


def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.outer(positions.reshape(-1), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_2d(dim: int, grid: int) -> np.ndarray:
    """(grid*grid, dim) embedding, tokens row-major; first half encodes the column, second the row."""
    cols, rows = np.meshgrid(np.arange(grid, dtype=np.float32), np.arange(grid, dtype=np.float32))
    return np.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=1)


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def relative_position_index(window: int) -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return rel[:, :, 0] * (2 * window - 1) + rel[:, :, 1]


# ------------------------------------------------------------------ layers
class RMSNorm(nn.Module):
    """x / ||x|| * sqrt(dim) * g over the last dimension."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.g = nn.Parameter(torch.ones(1, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.g * self.scale


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.SiLU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, c3 = qkv.shape
    q, k, v = qkv.reshape(b, n, 3, heads, c3 // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


class Attention(nn.Module):
    """Global multi-head self-attention over all tokens."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class WindowAttention(nn.Module):
    """Multi-head attention inside one window, with a learned relative position bias."""

    def __init__(self, dim: int, window: int, num_heads: int) -> None:
        super().__init__()
        self.window, self.num_heads = window, num_heads
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window))
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        bias = bias.view(n, n, self.num_heads).permute(2, 0, 1).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.unsqueeze(0))
        return self.proj(out.transpose(1, 2).reshape(x.shape))


class SwinAttention(nn.Module):
    """Non-overlapping window partition of the (grid x grid) tokens around :class:`WindowAttention`."""

    def __init__(self, dim: int, grid: int, num_heads: int, window: int) -> None:
        super().__init__()
        self.grid = grid
        self.window = grid if grid <= window else window
        self.attn = WindowAttention(dim, self.window, num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        g, w = self.grid, self.window
        windows = x.view(b, g // w, w, g // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)
        out = self.attn(windows).view(b, g // w, g // w, w, w, c)
        return out.permute(0, 1, 3, 2, 4, 5).reshape(b, g * g, c)


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block: RMSNorm, (windowed) attention, SiLU MLP, six modulation vectors."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, grid: int = 0, window: int = 0) -> None:
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = SwinAttention(dim, grid, num_heads, window) if window else Attention(dim, num_heads)
        self.norm2 = RMSNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_a.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class PatchMerging(nn.Module):
    """(N, g*g, C) -> (N, g/2*g/2, C): concatenate 2x2 neighbours, LayerNorm(4C), Linear 4C -> C."""

    def __init__(self, grid: int, dim: int) -> None:
        super().__init__()
        self.grid = grid
        self.reduction = nn.Linear(4 * dim, dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, c = x.shape
        h = self.grid // 2
        # neighbour order (row, col): (0,0), (1,0), (0,1), (1,1)
        x = x.view(b, h, 2, h, 2, c).permute(0, 1, 3, 4, 2, 5).reshape(b, h * h, 4 * c)
        return self.reduction(self.norm(x))


class TokensToGrid(nn.Module):
    def __init__(self, grid: int) -> None:
        super().__init__()
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], self.grid, self.grid)


class NearestUp2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nearest_upsample(x, 2)


class GridToTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


class TokenUpsample(nn.Sequential):
    """Tokens -> grid -> nearest 2x -> 1x1 conv -> tokens (index 2 holds the conv, as in the original)."""

    def __init__(self, grid: int, dim: int) -> None:
        super().__init__(TokensToGrid(grid), NearestUp2(), nn.Conv2d(dim, dim, 1), GridToTokens())


class Unet(nn.Module):
    """Windowed blocks, ``scales`` down stages, a middle block, ``scales`` up stages, windowed blocks."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        dim, heads, ratio, grid = cfg.hidden_size, cfg.num_heads, cfg.mlp_ratio, cfg.grid
        self.in_names = [f"swinIn{i + 1}" for i in range(cfg.window_depth)]
        self.out_names = [f"swinOut{i + 1}" for i in range(cfg.window_depth)]
        for name in self.in_names + self.out_names:
            self.add_module(name, DiTBlock(dim, heads, ratio, grid, cfg.window))
        self.downs = nn.ModuleList()
        for level in range(cfg.scales):
            blocks = [DiTBlock(dim, heads, ratio) for _ in range(cfg.stage_depth)]
            self.downs.append(nn.ModuleList([PatchMerging(grid >> level, dim), *blocks]))
        self.mid = DiTBlock(dim, heads, ratio)
        self.ups = nn.ModuleList()
        for level in reversed(range(cfg.scales)):
            blocks = [DiTBlock(dim, heads, ratio) for _ in range(cfg.stage_depth)]
            self.ups.append(nn.ModuleList([TokenUpsample(grid >> (level + 1), dim), nn.Linear(2 * dim, dim), *blocks]))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        for name in self.in_names:
            x = getattr(self, name)(x, c)
        skips = []
        for merge, *blocks in self.downs:
            skips.append(x)
            x = merge(x)
            for block in blocks:
                x = block(x, c)
        x = self.mid(x, c)
        for upsample, linear, *blocks in self.ups:
            x = linear(torch.cat([upsample(x), skips.pop()], dim=2))
            for block in blocks:
                x = block(x, c)
        for name in self.out_names:
            x = getattr(self, name)(x, c)
        return x


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, in_channels: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, frequency_size: int = 256) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t, self.frequency_size))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, patch: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = RMSNorm(dim)
        self.linear = nn.Linear(dim, patch * patch * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


# ------------------------------------------------------------------ model
class DiT(nn.Module):
    """Conditional denoiser: ``forward(x, t, y)`` with x (N,1,S,S), t (N,), y the EIM (N,1,16,16).

    Returns the predicted clean image x0, shape (N, out_channels, S, S).
    """

    def __init__(self, cfg: DiTConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or DiTConfig()
        cfg.validate()
        self.cfg = cfg
        dim = cfg.hidden_size
        self.x_embedder = PatchEmbed(cfg.patch_size, cfg.in_channels, dim)
        self.t_embedder = TimestepEmbedder(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, cfg.grid * cfg.grid, dim), requires_grad=False)
        self.blocks = Unet(cfg)
        self.final_layer = FinalLayer(dim, cfg.patch_size, cfg.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Conv2d):
                nn.init.kaiming_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        self.pos_embed.data.copy_(torch.from_numpy(sincos_2d(self.cfg.hidden_size, self.cfg.grid)).float()[None])
        weight = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(weight.view(weight.shape[0], -1))
        nn.init.zeros_(self.x_embedder.proj.bias)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        zero_out = [m.adaLN_modulation[-1] for m in self.modules() if isinstance(m, (DiTBlock, FinalLayer))]
        for layer in [*zero_out, self.final_layer.linear]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        p, c, g = self.cfg.patch_size, self.cfg.out_channels, self.cfg.grid
        x = x.reshape(x.shape[0], g, g, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(x.shape[0], c, g * p, g * p)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cond = nearest_upsample(y.to(x.dtype), self.cfg.image_size // EIM_SIZE)
        tokens = self.x_embedder(torch.cat([x, cond], dim=1)) + self.pos_embed
        c = self.t_embedder(t)
        tokens = self.blocks(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def training_flops(cfg: DiTConfig) -> int:
    """Training FLOPs of one sample, counted by hand: 3x the forward's matmul and convolution
    FLOPs (2 per multiply-add), the convention of ``raytpu.worker.flops``; elementwise work is left out.

    The forward's count equals what ``torch.utils.flop_counter.FlopCounterMode`` counts for
    :class:`DiT` (attention through the math kernel), checked in ``tests/test_flops.py``; a real
    backward is a hair under 2x the forward (no gradient for the inputs of the first layers).
    """
    d, p, grid = cfg.hidden_size, cfg.patch_size, cfg.grid
    mlp = int(d * cfg.mlp_ratio)

    def block(tokens: int, span: int) -> int:
        """A DiT block over ``tokens`` tokens, each attending to ``span`` of them."""
        modulation = d * 6 * d  # once per sample
        linear = tokens * (3 * d * d + d * d + 2 * d * mlp)  # qkv, proj, fc1, fc2
        attention = 2 * tokens * span * d  # Q K^T and A V
        return modulation + linear + attention

    window = min(cfg.window, grid)
    macs = grid * grid * d * cfg.in_channels * p * p  # patch embedding
    macs += 256 * d + d * d  # timestep embedder (256 frequencies)
    macs += 2 * cfg.window_depth * block(grid * grid, window * window)  # swinIn*, swinOut*
    for level in range(cfg.scales):
        tokens = (grid >> (level + 1)) ** 2
        macs += tokens * 4 * d * d + cfg.stage_depth * block(tokens, tokens)  # merge 2x2, blocks
        finer = (grid >> level) ** 2
        macs += finer * (d * d + 2 * d * d) + cfg.stage_depth * block(finer, finer)  # up: conv 1x1, linear
    coarsest = (grid >> cfg.scales) ** 2
    macs += block(coarsest, coarsest)  # mid
    macs += d * 2 * d + grid * grid * d * p * p * cfg.out_channels  # final layer
    return 3 * 2 * macs
