"""Synthetic IRSTD layout and the dataset: shapes, mask values, pure augmentation, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from raytpu.jobs.mshnet.data import IRSTDDataset
from raytpu.jobs.mshnet.synth import synthesize


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("irstd")
    synthesize(root, n=100, size=128, seed=3)
    return root


def names(root, listing: str) -> list[str]:
    return (root / listing).read_text().split()


def test_synthetic_layout_counts_and_split(synth_root):
    train, test = names(synth_root, "trainval.txt"), names(synth_root, "test.txt")
    assert len(train) == 80 and len(test) == 20 and not set(train) & set(test)
    assert sorted(p.stem for p in (synth_root / "images").glob("*.png")) == sorted(train + test)
    assert sorted(p.stem for p in (synth_root / "masks").glob("*.png")) == sorted(train + test)
    image = np.asarray(Image.open(synth_root / "images" / f"{train[0]}.png"))
    mask = np.asarray(Image.open(synth_root / "masks" / f"{train[0]}.png"))
    assert image.shape == mask.shape == (128, 128) and image.dtype == np.uint8
    assert set(np.unique(mask)) == {0, 255}
    for name in train + test:  # every image has at least one labelled target pixel
        assert np.asarray(Image.open(synth_root / "masks" / f"{name}.png")).any()


def test_synthesis_is_reproducible_from_the_seed(synth_root, tmp_path):
    synthesize(tmp_path / "same", n=10, size=128, seed=3)
    synthesize(tmp_path / "other", n=10, size=128, seed=4)
    name = "synth_00007"
    for folder in ("images", "masks"):
        original = (synth_root / folder / f"{name}.png").read_bytes()
        assert (tmp_path / "same" / folder / f"{name}.png").read_bytes() == original
    assert (tmp_path / "other" / "images" / f"{name}.png").read_bytes() != original


def test_eval_items_are_resized_to_base_size(synth_root):
    dataset = IRSTDDataset(synth_root, "test", base_size=64, crop_size=32)
    assert len(dataset) == 20
    item = dataset[0]
    assert item["image"].shape == (3, 64, 64) and item["image"].dtype == torch.float32
    assert item["mask"].shape == (1, 64, 64) and item["mask"].dtype == torch.float32
    assert set(item["mask"].unique().tolist()) <= {0.0, 1.0}
    # grey PNG read as 3 channels, ImageNet-normalised per channel
    grey = item["image"] * torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    grey = grey + torch.tensor([0.485, 0.456, 0.406])[:, None, None]
    torch.testing.assert_close(grey[0], grey[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(dataset[0]["image"], item["image"])  # no randomness in eval


def test_train_items_have_the_crop_shape_for_every_rescale(synth_root):
    dataset = IRSTDDataset(synth_root, "train", base_size=64, crop_size=96, seed=0)
    assert len(dataset) == 80
    for epoch in range(3):
        dataset.set_epoch(epoch)
        for index in range(8):  # long side 32..128: both the pad and the crop paths
            item = dataset[index]
            assert item["image"].shape == (3, 96, 96) and item["mask"].shape == (1, 96, 96)
            assert set(item["mask"].unique().tolist()) <= {0.0, 1.0}


def test_augmentation_is_a_pure_function_of_seed_epoch_and_index(synth_root):
    first = IRSTDDataset(synth_root, "train", base_size=64, crop_size=64, seed=7)
    first.set_epoch(2)
    reference = [first[i] for i in (5, 0, 3)]
    second = IRSTDDataset(synth_root, "train", base_size=64, crop_size=64, seed=7)
    second.set_epoch(0)
    _ = second[3]  # earlier draws must not matter
    second.set_epoch(2)
    for index, expected in zip((5, 0, 3), reference):
        item = second[index]
        assert torch.equal(item["image"], expected["image"]) and torch.equal(item["mask"], expected["mask"])
    second.set_epoch(3)
    other_seed = IRSTDDataset(synth_root, "train", base_size=64, crop_size=64, seed=8)
    other_seed.set_epoch(2)
    assert not torch.equal(second[5]["image"], reference[0]["image"])
    assert not torch.equal(other_seed[5]["image"], reference[0]["image"])


@pytest.mark.parametrize("missing", ["images", "masks", "trainval.txt"])
def test_missing_folder_or_list_is_a_one_line_error(synth_root, tmp_path, missing):
    root = tmp_path / "data"
    root.mkdir()
    for part in ("images", "masks"):
        (root / part).mkdir()
    (root / "trainval.txt").write_text("a\n")
    target = root / missing
    target.rmdir() if target.is_dir() else target.unlink()
    with pytest.raises(FileNotFoundError) as info:
        IRSTDDataset(root, "train", 32, 32)
    message = str(info.value)
    assert "\n" not in message and str(target) in message and "raytpu data synth mshnet --out" in message


def test_nowhere_and_unknown_split_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.*raytpu data synth mshnet"):
        IRSTDDataset(tmp_path / "nowhere", "train", 32, 32)
    with pytest.raises(ValueError, match="unknown IRSTD split 'val'"):
        IRSTDDataset(tmp_path, "val", 32, 32)
