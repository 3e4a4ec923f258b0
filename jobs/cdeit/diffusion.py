"""Gaussian diffusion for CDEIT: linear schedule, x0-predicting model, L1 loss and the DDIM-EIT sampler.

The schedule is computed in float64 and kept as float32 tables (what the
authors' code casts to before use). Everything works on fixed shapes with no
host synchronisation, so it runs unchanged on XLA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Diffusion:
    """Forward process q(x_t | x_0) with ``timesteps`` linear betas from ``beta_start`` to ``beta_end``."""

    def __init__(self, timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> None:
        self.num_timesteps = timesteps
        betas = torch.linspace(beta_start, beta_end, timesteps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.betas = betas
        self.alphas_cumprod = alphas_cumprod
        self.sqrt_alphas_cumprod = alphas_cumprod.sqrt().float()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod).sqrt().float()
        self.sqrt_recip_alphas_cumprod = (1.0 / alphas_cumprod).sqrt().float()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / alphas_cumprod - 1.0).sqrt().float()

    @staticmethod
    def _take(table: torch.Tensor, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """table[t] shaped (N, 1, 1, ...) to broadcast against ``like``."""
        values = table.to(t.device)[t].to(like.dtype)
        return values.view(-1, *([1] * (like.dim() - 1)))

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) noise."""
        return (
            self._take(self.sqrt_alphas_cumprod, t, x0) * x0
            + self._take(self.sqrt_one_minus_alphas_cumprod, t, x0) * noise
        )

    def predict_eps(self, x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """The noise implied by a prediction of x0 at x_t."""
        return (self._take(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - x0) / self._take(
            self.sqrt_recipm1_alphas_cumprod, t, x_t
        )

    def sample_t(self, n: int, device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
        """Uniform timesteps in [0, T)."""
        return torch.randint(0, self.num_timesteps, (n,), device=device, generator=generator)

    def training_loss(
        self, model: Denoiser, x0: torch.Tensor, y: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, kind: str = "l1"
    ) -> torch.Tensor:
        """Mean L1 (the authors') or squared error between the model's x0 prediction at x_t and x0."""
        prediction = model(self.q_sample(x0, t, noise), t, y)
        return pixel_errors(prediction, x0, kind).mean()

    def sampling_timesteps(self, steps: int) -> list[int]:
        """The DDIM-EIT schedule: linspace(-1, T-1, steps+1) truncated to int, descending, ending at -1."""
        times = torch.linspace(-1, self.num_timesteps - 1, steps + 1).int().tolist()
        return list(reversed(times))

    def step_coefficients(self, time: int, time_next: int, eta: float) -> tuple[float, float, float]:
        """(sqrt(abar_next), c, sigma) of one DDIM step, computed in float32 like the original."""
        alpha = self.alphas_cumprod[time].float()
        alpha_next = self.alphas_cumprod[time_next].float()
        sigma = eta * ((1 - alpha / alpha_next) * (1 - alpha_next) / (1 - alpha)).sqrt()
        c = (1 - alpha_next - sigma**2).sqrt()
        return float(alpha_next.sqrt()), float(c), float(sigma)

    def sample(
        self,
        model: Denoiser,
        y: torch.Tensor,
        shape: tuple[int, ...],
        steps: int = 5,
        eta: float = 1.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """DDIM-EIT: start from noise, predict x0 at each of ``steps`` timesteps, return the last x0.

        ``noise`` (steps, *shape) fixes every draw (the start and one per
        intermediate step); else it is drawn from ``generator`` (on the
        generator's device, then moved to ``y``'s), else from the global RNG.
        No clipping is applied to the x0 predictions.
        """
        if noise is None:
            device = generator.device if generator is not None else y.device
            noise = torch.randn((steps, *shape), generator=generator, device=device)
        noise = noise.to(device=y.device, dtype=torch.float32)
        times = self.sampling_timesteps(steps)
        img, x0 = noise[0], noise[0]
        for index, (time, time_next) in enumerate(zip(times[:-1], times[1:])):
            t = torch.full((shape[0],), time, device=y.device, dtype=torch.long)
            x0 = model(img, t, y).float()
            if time_next < 0:
                break
            sqrt_alpha_next, c, sigma = self.step_coefficients(time, time_next, eta)
            img = x0 * sqrt_alpha_next + c * self.predict_eps(img, t, x0) + sigma * noise[index + 1]
        return x0


def pixel_errors(prediction: torch.Tensor, x0: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-pixel |error| (``l1``) or error squared (``mse``), in float32."""
    error = prediction.float() - x0.float()
    return error.abs() if kind == "l1" else error.square()
