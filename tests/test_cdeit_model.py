"""CDEIT model: the authors' parameter count and names, small-config forward/backward."""

from __future__ import annotations

import torch

from raytpu.jobs.cdeit.model import SMALL, DiT, DiTConfig, count_parameters, nearest_upsample

#: a sample of the authors' state_dict (models.py, class DiT with its defaults): key -> shape
AUTHORS_KEYS = {
    "pos_embed": (1, 4096, 512),
    "x_embedder.proj.weight": (512, 2, 2, 2),
    "t_embedder.mlp.0.weight": (512, 256),
    "t_embedder.mlp.2.bias": (512,),
    "blocks.swinIn1.norm1.g": (1, 1, 512),
    "blocks.swinIn1.attn.attn.relative_position_bias_table": (961, 16),
    "blocks.swinIn1.attn.attn.relative_position_index": (256, 256),
    "blocks.swinIn2.attn.attn.qkv.weight": (1536, 512),
    "blocks.swinOut2.adaLN_modulation.1.weight": (3072, 512),
    "blocks.downs.0.0.reduction.weight": (512, 2048),
    "blocks.downs.3.0.norm.bias": (2048,),
    "blocks.downs.1.2.mlp.fc1.weight": (2048, 512),
    "blocks.downs.2.1.attn.qkv.bias": (1536,),
    "blocks.mid.attn.proj.weight": (512, 512),
    "blocks.ups.0.0.2.weight": (512, 512, 1, 1),
    "blocks.ups.3.1.weight": (512, 1024),
    "blocks.ups.2.3.mlp.fc2.weight": (512, 2048),
    "final_layer.norm_final.g": (1, 1, 512),
    "final_layer.linear.weight": (4, 512),
    "final_layer.adaLN_modulation.1.weight": (1024, 512),
}


def test_default_config_has_the_authors_parameters() -> None:
    with torch.device("meta"):
        model = DiT()
    assert count_parameters(model) == 109_719_108
    state = model.state_dict()
    assert len(state) == 300
    assert {k: tuple(state[k].shape) for k in AUTHORS_KEYS} == AUTHORS_KEYS
    assert not model.pos_embed.requires_grad


def test_small_config_forward_backward() -> None:
    torch.manual_seed(0)
    model = DiT(SMALL)
    assert 1_600_000 < count_parameters(model) < 1_800_000
    for p in model.parameters():  # leave the zero init so every path carries signal
        if p.requires_grad:
            p.data.add_(0.02 * torch.randn_like(p))
    x, y = torch.randn(3, 1, 32, 32), torch.randn(3, 1, 16, 16)
    t = torch.tensor([0, 500, 999])
    out = model(x, t, y)
    assert out.shape == (3, 1, 32, 32)
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        assert not torch.allclose(model(x, t, torch.zeros_like(y)), out)  # the condition is used
        assert not torch.allclose(model(x, t.flip(0), y), out)  # so is the timestep


def test_configurable_depths_and_window() -> None:
    cfg = DiTConfig(image_size=32, hidden_size=32, num_heads=4, window_size=8, scales=2, stage_depth=1, window_depth=1)
    model = DiT(cfg)
    names = {k.split(".")[1] for k in model.state_dict() if k.startswith("blocks.")}
    assert names == {"swinIn1", "swinOut1", "downs", "mid", "ups"}
    assert model.blocks.swinIn1.attn.window == 8
    assert model(torch.randn(2, 1, 32, 32), torch.tensor([1, 2]), torch.randn(2, 1, 16, 16)).shape == (2, 1, 32, 32)


def test_nearest_upsample_matches_interpolate() -> None:
    y = torch.randn(2, 1, 16, 16)
    assert torch.equal(nearest_upsample(y, 8), torch.nn.functional.interpolate(y, scale_factor=8, mode="nearest"))
