"""A synthetic stand-in for IRSTD-1k in its exact file layout.

Grey clutter (low-pass noise plus a gradient) with 1-3 Gaussian point targets;
the mask is where a target exceeds half its peak. Every image is a pure
function of (seed, index), so the set is reproducible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from skimage.filters import gaussian


def clutter(rng: np.random.Generator, size: int) -> np.ndarray:
    noise = gaussian(rng.normal(size=(size, size)), sigma=rng.uniform(2, 6))
    noise = (noise - noise.mean()) / (noise.std() + 1e-8)
    yy, xx = np.mgrid[0:size, 0:size] / size
    angle = rng.uniform(0, 2 * np.pi)
    gradient = np.cos(angle) * xx + np.sin(angle) * yy
    return rng.uniform(60, 120) + rng.uniform(10, 30) * noise + rng.uniform(0, 40) * gradient


def add_targets(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
    size = image.shape[0]
    mask = np.zeros_like(image, dtype=bool)
    yy, xx = np.mgrid[0:size, 0:size]
    for _ in range(rng.integers(1, 4)):
        cy, cx = rng.uniform(4, size - 4, size=2)
        sigma = rng.uniform(0.5, 3.0)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma**2))
        image += rng.uniform(20, 80) * blob
        mask |= blob > 0.5
    return mask


def make_sample(seed: int, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng((seed, index))
    image = clutter(rng, size)
    mask = add_targets(rng, image)
    return np.clip(image, 0, 255).astype(np.uint8), (mask * 255).astype(np.uint8)


def synthesize(out: Path, n: int = 100, size: int = 128, seed: int = 0, test_fraction: float = 0.2) -> None:
    """Write ``n`` images and masks (``size`` x ``size`` PNG) and the split lists under ``out``."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    names = [f"synth_{index:05d}" for index in range(n)]
    for index, name in enumerate(names):
        image, mask = make_sample(seed, index, size)
        Image.fromarray(image).save(out / "images" / f"{name}.png")
        Image.fromarray(mask).save(out / "masks" / f"{name}.png")
    n_test = max(1, round(n * test_fraction))
    order = np.random.default_rng(seed).permutation(n)
    test = sorted(names[i] for i in order[:n_test])
    train = sorted(names[i] for i in order[n_test:])
    (out / "trainval.txt").write_text("\n".join(train) + "\n")
    (out / "test.txt").write_text("\n".join(test) + "\n")
