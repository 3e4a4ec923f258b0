"""CDEIT data: pyEIT simulation, file layout, reproducibility, EIM, stats/path lookup, the real UEF2017 files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from raytpu.config import load_config
from raytpu.jobs.cdeit import JOB
from raytpu.jobs.cdeit.data import (
    EITDataset,
    eval_dataset,
    find_stats,
    normalise_voltages,
    resolve_data_root,
    to_eim,
)
from raytpu.jobs.cdeit.synth import N_READINGS, simulator, synthesize

ROOT = Path(__file__).resolve().parents[1]
REAL = Path(os.environ.get("CDEIT_REAL_DATA", ROOT.parent / "shared" / "data" / "cdeit-real"))
KEYS = {"xs", "ys", "xs_gn", "TR"}


@pytest.fixture(scope="module")
def synth_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cdeit") / "data"
    synthesize(root, n_train=14, n_valid=2, n_test=2, size=32, seed=3, processes=2)  # 18 samples: 2 processes
    return root


def small_config(data_path: Path, *overrides: str):
    cfg, _ = load_config(ROOT / "jobs/cdeit/small.yaml", [f"data.path={data_path}", *overrides])
    return cfg


def test_pyeit_forward_gives_208_adjacent_readings() -> None:
    sim = simulator(32)
    assert sim.fwd.protocol.ex_mat.tolist()[:2] == [[0, 1], [1, 2]]
    assert sim.fwd.protocol.meas_mat.shape == (16, 13, 2)
    assert sim.fwd.solve_eit(1.0).shape == (N_READINGS,)


def test_synth_layout_keys_shapes_dtypes(synth_root: Path) -> None:
    counts = {split: len(list((synth_root / split).glob("*.npz"))) for split in ("train", "valid", "test")}
    assert counts == {"train": 14, "valid": 2, "test": 2}
    with np.load(synth_root / "train" / "000000.npz") as sample:
        assert set(sample.files) == KEYS
        shapes = {k: (sample[k].shape, sample[k].dtype) for k in KEYS}
        xs = sample["xs"]
    assert shapes["ys"] == ((208, 1), np.float32)
    for key in ("xs", "xs_gn", "TR"):
        assert shapes[key] == ((32, 32), np.float32)
    assert xs[0, 0] == 0 and np.abs(xs).max() <= 1.0 and np.abs(xs).max() >= 0.7


def test_synth_stats_shape_and_recompute(synth_root: Path) -> None:
    mean = torch.load(synth_root / "mean.pth", weights_only=True)
    std = torch.load(synth_root / "std.pth", weights_only=True)
    assert mean.shape == std.shape == (1, 16, 13)
    assert mean.dtype == std.dtype == torch.float32 and bool((std > 0).all())
    ys = np.stack([np.load(f)["ys"][:, 0] for f in sorted((synth_root / "train").glob("*.npz"))])
    assert np.allclose(mean.numpy().ravel(), ys.mean(0), rtol=1e-5, atol=1e-9)
    summary = JOB.compute_stats(synth_root)
    assert summary["samples"] == 14
    assert torch.equal(torch.load(synth_root / "mean.pth", weights_only=True), mean)


def test_same_seed_same_arrays_any_process_count(synth_root: Path, tmp_path: Path) -> None:
    again = synthesize(tmp_path / "again", n_train=2, n_valid=1, n_test=1, size=32, seed=3, processes=1)
    other = synthesize(tmp_path / "other", n_train=2, n_valid=1, n_test=1, size=32, seed=4, processes=1)
    for name in ("train/000000.npz", "train/000001.npz", "valid/000000.npz", "test/000000.npz"):
        with np.load(synth_root / name) as a, np.load(again / name) as b:
            for key in KEYS:
                assert a[key].tobytes() == b[key].tobytes(), (name, key)
    with np.load(synth_root / "train/000000.npz") as a, np.load(other / "train/000000.npz") as b:
        assert not np.array_equal(a["ys"], b["ys"])


def test_eim_on_known_input() -> None:
    readings = torch.arange(208, dtype=torch.float32).reshape(1, 16, 13) + 1
    eim = to_eim(readings)
    assert eim.shape == (1, 16, 16)
    assert eim[0, 0].tolist() == [0, 0, *range(1, 14), 0]  # drive 0: zeros at 15, 0, 1
    assert eim[0, 1, :3].tolist() == [0, 0, 0] and eim[0, 1, 3:].tolist() == list(range(14, 27))
    assert eim[0, 15].tolist() == [0, *range(196, 209), 0, 0]  # drive 15: zeros at 14, 15, 0
    for r in range(16):
        zeros = {(r - 1) % 16, r, (r + 1) % 16}
        assert {c for c in range(16) if eim[0, r, c] == 0} == zeros


def test_normalise_voltages_divides_then_standardises() -> None:
    ys = np.arange(208, dtype=np.float32).reshape(208, 1)
    mean, std = torch.full((1, 16, 13), 2.0), torch.full((1, 16, 13), 4.0)
    eim = normalise_voltages(ys, mean, std, scale=10.0)
    assert eim[0, 0, 2].item() == pytest.approx((0 / 10 - 2) / 4)
    assert eim[0, 3, 5].item() == pytest.approx((3 * 13 + 2) / 10 / 4 - 0.5)  # third reading of drive 3


def test_dataset_items(synth_root: Path) -> None:
    item = EITDataset(synth_root, "valid", *find_stats(synth_root))[1]
    assert {k: (tuple(v.shape), v.dtype) for k, v in item.items()} == {
        "x": ((1, 32, 32), torch.float32),
        "y": ((1, 16, 16), torch.float32),
        "tr": ((1, 32, 32), torch.float32),
    }


def test_stats_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "set"
    root.mkdir()
    with pytest.raises(FileNotFoundError, match=r"'.*set' and 'data'"):
        find_stats(root)
    (tmp_path / "data").mkdir()
    torch.save(torch.zeros(1, 16, 13), tmp_path / "data" / "mean.pth")
    torch.save(torch.ones(1, 16, 13), tmp_path / "data" / "std.pth")
    assert float(find_stats(root)[1].mean()) == 1.0
    torch.save(torch.ones(1, 16, 13), root / "mean.pth")
    torch.save(torch.full((1, 16, 13), 3.0), root / "std.pth")
    mean, std = find_stats(root)
    assert float(mean.mean()) == 1.0 and float(std.mean()) == 3.0


def test_data_root_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"neither 'missing' nor 'data/cdeit'"):
        resolve_data_root("missing")
    (tmp_path / "data" / "cdeit").mkdir(parents=True)
    with pytest.warns(UserWarning, match="does not exist"):
        assert resolve_data_root("missing") == Path("data/cdeit")
    assert resolve_data_root("data") == Path("data")


def test_job_datasets_and_eval_set_errors(synth_root: Path) -> None:
    cfg = small_config(synth_root)
    assert len(JOB.build_dataset(cfg, "train", synth_root)) == 14
    assert len(JOB.build_dataset(cfg, "test", synth_root)) == 2
    with pytest.raises(FileNotFoundError, match="ktc2023"):
        JOB.build_dataset(small_config(synth_root, "--data", "ktc2023"), "test", synth_root)
    with pytest.raises(ValueError, match="image_size"):
        JOB.build_dataset(small_config(synth_root, "job.image_size=64"), "train", synth_root)


@pytest.mark.skipif(not (REAL / "uef2017").is_dir(), reason="shared UEF2017 measurements not present")
def test_uef2017_real_files_load_with_voltage_scale() -> None:
    mean, std = find_stats(REAL)
    dataset = eval_dataset(REAL, "uef2017", mean, std)
    assert len(dataset) == 22 and dataset.voltage_scale == 1040.856
    item = dataset[0]
    assert item["x"].shape == item["tr"].shape == (1, 128, 128) and item["y"].shape == (1, 16, 16)
    with np.load(dataset.files[0]) as raw:
        readings = torch.from_numpy(raw["ys"]).reshape(1, 16, 13) / 1040.856
    expected = to_eim((readings - mean) / std)
    assert torch.allclose(item["y"], expected)
    ys = torch.stack([dataset[i]["y"] for i in range(len(dataset))])
    assert torch.isfinite(ys).all() and ys.abs().mean() < 10  # the scale maps real data near the simulated range
    cfg = small_config(REAL, "--data", "uef2017", "job.image_size=128")
    assert len(JOB.build_dataset(cfg, "test", REAL)) == 22
