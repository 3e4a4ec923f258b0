"""IRSTD-1k-layout dataset: ``images/NAME.png``, ``masks/NAME.png``, ``trainval.txt``, ``test.txt``.

Training augmentation (flip, rescale of the long side in [0.5, 2] x base_size,
pad, random crop, Gaussian blur p=0.5, as the authors' ``_sync_transform``)
draws from ``default_rng((seed, epoch, index))`` only: a pure function of
those three numbers, whatever the worker, the DataLoader process or a resume in
the middle of an epoch. Evaluation resizes to base_size x base_size.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageFilter, ImageOps
from torch.utils.data import Dataset

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
LISTS = {"train": "trainval.txt", "test": "test.txt"}


def read_names(root: Path, split: str) -> list[str]:
    """Image names of ``split``; a one-line error naming what is missing and how to make a data set."""
    if split not in LISTS:
        raise ValueError(f"unknown IRSTD split {split!r}; use one of {sorted(LISTS)}")
    listing = root / LISTS[split]
    for required in (root / "images", root / "masks", listing):
        if not required.exists():
            raise FileNotFoundError(
                f"{required} is missing: an IRSTD-format data set needs images/, masks/, trainval.txt and test.txt; "
                f"point --dataset-dir at one or make one with `raytpu data synth mshnet --out {root}`"
            )
    names = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    if not names:
        raise ValueError(f"{listing} lists no images; add names (without .png), one per line")
    return names


def open_png(path: Path, mode: str) -> Image.Image:
    """A PNG decoded in ``mode``; a missing or corrupt file is a one-line error that names it."""
    try:
        with Image.open(path) as image:
            return image.convert(mode)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"{path}: cannot read this image ({reason}); fix or remove it from the split's list") from exc


def to_tensors(image: Image.Image, mask: Image.Image) -> dict[str, torch.Tensor]:
    """ImageNet-normalised (3, H, W) image and a {0, 1} (1, H, W) mask, both float32."""
    pixels = (np.asarray(image, dtype=np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    labels = (np.asarray(mask, dtype=np.float32) > 127).astype(np.float32)
    return {
        "image": torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1))),
        "mask": torch.from_numpy(labels[None]),
    }


def decode_pair(image: bytes, mask: bytes) -> tuple[Image.Image, Image.Image]:
    """PNG bytes (as ``raytpu data prepare`` stores them) -> the RGB image and L mask that
    :meth:`IRSTDDataset.load` opens."""
    return Image.open(io.BytesIO(image)).convert("RGB"), Image.open(io.BytesIO(mask)).convert("L")


def rescale_size(width: int, height: int, long_side: int) -> tuple[int, int]:
    """(width, height) with the longer side set to ``long_side``, rounded half up as the authors do."""
    if height > width:
        return max(1, int(width * long_side / height + 0.5)), long_side
    return long_side, max(1, int(height * long_side / width + 0.5))


class IRSTDTransform:
    """What turns one decoded (image, mask) pair into an item: the paper's train
    augmentation or the eval resize. Shared by :class:`IRSTDDataset` and the
    Ray Data path, which decodes the same PNG bytes from parquet."""

    def __init__(self, base_size: int, crop_size: int, seed: int = 0, augment: bool = False) -> None:
        self.base_size, self.crop_size = base_size, crop_size
        self.augment = augment
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def item(self, image: Image.Image, mask: Image.Image, index: int) -> dict[str, torch.Tensor]:
        if self.augment:
            rng = np.random.default_rng((self.seed, self.epoch, index))
            image, mask = self.random_transform(rng, image, mask)
        else:
            size = (self.base_size, self.base_size)
            image, mask = image.resize(size, Image.BILINEAR), mask.resize(size, Image.NEAREST)
        return to_tensors(image, mask)

    def random_transform(
        self, rng: np.random.Generator, image: Image.Image, mask: Image.Image
    ) -> tuple[Image.Image, Image.Image]:
        """Flip, rescale, pad, crop and blur; every random number comes from ``rng``."""
        crop = self.crop_size
        if rng.random() < 0.5:
            image, mask = ImageOps.mirror(image), ImageOps.mirror(mask)
        long_side = int(rng.integers(int(self.base_size * 0.5), int(self.base_size * 2.0), endpoint=True))
        new_size = rescale_size(*image.size, long_side)
        image, mask = image.resize(new_size, Image.BILINEAR), mask.resize(new_size, Image.NEAREST)
        pad_w, pad_h = max(crop - new_size[0], 0), max(crop - new_size[1], 0)
        if pad_w or pad_h:
            image = ImageOps.expand(image, border=(0, 0, pad_w, pad_h), fill=0)
            mask = ImageOps.expand(mask, border=(0, 0, pad_w, pad_h), fill=0)
        width, height = image.size
        left = int(rng.integers(0, width - crop, endpoint=True))
        top = int(rng.integers(0, height - crop, endpoint=True))
        image, mask = image.crop((left, top, left + crop, top + crop)), mask.crop((left, top, left + crop, top + crop))
        if rng.random() < 0.5:
            image = image.filter(ImageFilter.GaussianBlur(radius=float(rng.random())))
        return image, mask


class IRSTDDataset(IRSTDTransform, Dataset):
    """Map-style IRSTD data set; ``split`` is ``"train"`` (trainval.txt) or ``"test"`` (test.txt).

    ``augment`` defaults to ``split == "train"``. Items have fixed shapes:
    crop_size x crop_size when augmenting, base_size x base_size otherwise.
    """

    def __init__(
        self,
        root: Path,
        split: str,
        base_size: int,
        crop_size: int,
        seed: int = 0,
        augment: bool | None = None,
    ) -> None:
        super().__init__(base_size, crop_size, seed, split == "train" if augment is None else augment)
        self.root = Path(root)
        self.names = read_names(self.root, split)

    def __len__(self) -> int:
        return len(self.names)

    def load(self, index: int) -> tuple[Image.Image, Image.Image]:
        name = self.names[index]
        return open_png(self.root / "images" / f"{name}.png", "RGB"), open_png(self.root / "masks" / f"{name}.png", "L")

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.item(*self.load(index), index)
