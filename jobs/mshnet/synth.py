"""A synthetic stand-in for IRSTD-1k in its exact file layout.

Grey clutter (low-pass noise plus a linear gradient, 0..255) with 1-3 Gaussian
point targets (sigma 0.5-3 px, contrast 20-80); a target's mask is where its
blob exceeds half of its sampled peak, so even the smallest target has at least
one labelled pixel. Every image is a pure function of (seed, index) and the
split of seed alone, so the set is reproducible.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from skimage.filters import gaussian

TEST_FRACTION = 0.2


def clutter(rng: np.random.Generator, size: int) -> np.ndarray:
    """A smooth random background: low-pass noise plus a gradient of random direction."""
    noise = gaussian(rng.normal(size=(size, size)), sigma=rng.uniform(2, 6))
    noise = (noise - noise.mean()) / (noise.std() + 1e-8)
    yy, xx = np.mgrid[0:size, 0:size] / size
    angle = rng.uniform(0, 2 * np.pi)
    gradient = np.cos(angle) * xx + np.sin(angle) * yy
    return rng.uniform(60, 120) + rng.uniform(10, 30) * noise + rng.uniform(0, 40) * gradient


def add_targets(rng: np.random.Generator, image: np.ndarray) -> np.ndarray:
    """Add 1-3 Gaussian blobs to ``image`` in place; return their boolean mask."""
    size = image.shape[0]
    mask = np.zeros(image.shape, dtype=bool)
    yy, xx = np.mgrid[0:size, 0:size]
    for _ in range(rng.integers(1, 4)):
        cy, cx = rng.uniform(4, size - 4, size=2)
        sigma = rng.uniform(0.5, 3.0)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma**2))
        image += rng.uniform(20, 80) * blob
        mask |= blob > 0.5 * blob.max()
    return mask


def make_sample(seed: int, index: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(image, mask) as uint8 arrays; the mask is 0/255."""
    rng = np.random.default_rng((seed, index))
    image = clutter(rng, size)
    mask = add_targets(rng, image)
    return np.clip(image, 0, 255).astype(np.uint8), (mask * 255).astype(np.uint8)


def split_names(names: list[str], seed: int) -> tuple[list[str], list[str]]:
    """(trainval, test): a seeded 80/20 split, each sorted."""
    n_test = max(1, round(len(names) * TEST_FRACTION))
    order = np.random.default_rng(seed).permutation(len(names))
    test = sorted(names[i] for i in order[:n_test])
    train = sorted(names[i] for i in order[n_test:])
    return train, test


def synthesize(out: Path, n: int = 100, size: int = 128, seed: int = 0) -> None:
    """Write ``n`` images and masks (``size`` x ``size`` grey PNG) and ``trainval.txt``/``test.txt`` under ``out``."""
    if n < 2 or size < 16:
        raise ValueError(f"synthetic MSHNet data needs n >= 2 and size >= 16 (got n={n}, size={size})")
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    names = [f"synth_{index:05d}" for index in range(n)]
    for index, name in enumerate(names):
        image, mask = make_sample(seed, index, size)
        Image.fromarray(image).save(out / "images" / f"{name}.png")
        Image.fromarray(mask).save(out / "masks" / f"{name}.png")
    train, test = split_names(names, seed)
    (out / "trainval.txt").write_text("\n".join(train) + "\n")
    (out / "test.txt").write_text("\n".join(test) + "\n")
