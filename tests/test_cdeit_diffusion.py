"""CDEIT diffusion: schedule, q_sample statistics, L1 loss, the DDIM-EIT sampler."""

from __future__ import annotations

import math

import pytest
import torch

from raytpu.jobs.cdeit.diffusion import Diffusion

DIFFUSION = Diffusion()


class Recorder:
    """A deterministic stand-in for the model that records the timesteps it sees."""

    def __init__(self) -> None:
        self.times: list[int] = []

    def __call__(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.times.append(int(t[0]))
        return 0.5 * x + y.mean(dim=(1, 2, 3), keepdim=True)


def test_linear_schedule() -> None:
    assert DIFFUSION.betas[0].item() == pytest.approx(1e-4) and DIFFUSION.betas[-1].item() == pytest.approx(0.02)
    expected = math.prod(1 - (1e-4 + i * (0.02 - 1e-4) / 999) for i in range(1000))
    assert DIFFUSION.alphas_cumprod[-1].item() == pytest.approx(expected, rel=1e-9)


def test_q_sample_statistics() -> None:
    torch.manual_seed(0)
    x0 = torch.full((20000, 1, 2, 2), 0.8)
    for step in (0, 250, 999):
        t = torch.full((20000,), step)
        xt = DIFFUSION.q_sample(x0, t, torch.randn_like(x0))
        abar = DIFFUSION.alphas_cumprod[step].item()
        assert xt.mean().item() == pytest.approx(0.8 * math.sqrt(abar), abs=0.01)
        assert xt.std().item() == pytest.approx(math.sqrt(1 - abar), abs=0.01)
    at_zero = DIFFUSION.q_sample(x0, torch.zeros(20000, dtype=torch.long), torch.zeros_like(x0))
    assert torch.allclose(at_zero, x0 * (1 - 1e-4) ** 0.5)


def test_l1_and_mse_losses_on_x0_prediction() -> None:
    x0 = torch.randn(4, 1, 8, 8)
    t = torch.tensor([1, 2, 3, 4])
    assert DIFFUSION.training_loss(lambda x, tt, y: x0, x0, torch.zeros(4, 1, 16, 16), t, torch.randn_like(x0)) == 0
    off = lambda x, tt, y: x0 + 0.25  # noqa: E731
    assert DIFFUSION.training_loss(off, x0, torch.zeros(4, 1, 16, 16), t, torch.randn_like(x0)).item() == (
        pytest.approx(0.25)
    )
    assert DIFFUSION.training_loss(off, x0, torch.zeros(4, 1, 16, 16), t, torch.randn_like(x0), "mse").item() == (
        pytest.approx(0.0625)
    )


def test_sampler_timesteps() -> None:
    assert DIFFUSION.sampling_timesteps(5) == [999, 799, 599, 399, 199, -1]
    assert DIFFUSION.sampling_timesteps(3) == [999, 665, 332, -1]
    model = Recorder()
    DIFFUSION.sample(model, torch.zeros(2, 1, 16, 16), (2, 1, 8, 8), steps=5, generator=torch.Generator())
    assert model.times == [999, 799, 599, 399, 199]


def test_sampler_update_formula_two_steps() -> None:
    model, y = Recorder(), torch.randn(2, 1, 16, 16)
    noise = torch.randn(2, 2, 1, 8, 8)
    out = DIFFUSION.sample(model, y, (2, 1, 8, 8), steps=2, noise=noise)
    a, an = DIFFUSION.alphas_cumprod[999].item(), DIFFUSION.alphas_cumprod[499].item()
    x0 = model(noise[0], torch.tensor([999, 999]), y)
    eps = (noise[0] / math.sqrt(a) - x0) / math.sqrt(1 / a - 1)
    sigma = math.sqrt((1 - a / an) * (1 - an) / (1 - a))
    img = x0 * math.sqrt(an) + math.sqrt(1 - an - sigma**2) * eps + sigma * noise[1]
    assert torch.allclose(out, model(img, torch.tensor([499, 499]), y), atol=1e-5)


def test_sampler_is_deterministic_under_a_seed() -> None:
    y, shape = torch.randn(2, 1, 16, 16), (2, 1, 8, 8)
    first = DIFFUSION.sample(Recorder(), y, shape, generator=torch.Generator().manual_seed(7))
    again = DIFFUSION.sample(Recorder(), y, shape, generator=torch.Generator().manual_seed(7))
    other = DIFFUSION.sample(Recorder(), y, shape, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    noise = torch.randn((5, *shape), generator=torch.Generator().manual_seed(7))
    assert torch.equal(DIFFUSION.sample(Recorder(), y, shape, noise=noise), first)
