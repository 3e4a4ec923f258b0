"""CDEIT data: one ``.npz`` per sample (``xs``, ``ys``, ``xs_gn``, ``TR``) under ``<root>/<split>/``.

``ys`` (208 difference voltages, 16 drives x 13 readings) are divided by the
set's voltage scale, normalised with ``mean.pth`` / ``std.pth`` and placed in a
16x16 "EIM": row r holds drive r's 13 readings in increasing column order,
skipping columns r-1, r, r+1 (mod 16), which stay zero (the authors' layout).
"""

from __future__ import annotations

import warnings
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

N_ELECTRODES = 16
N_PER_DRIVE = 13

#: eval set name -> (folder under the data root, voltage scale that maps it to the simulated units)
EVAL_SETS: dict[str, tuple[str, float]] = {
    "simulated": ("test", 1.0),
    "uef2017": ("uef2017", 1040.856),
    "ktc2023": ("ktc2023", 1978.0),
}


def eim_columns() -> torch.Tensor:
    """(16, 13) column of each reading: row r skips r-1, r, r+1 (mod 16)."""
    rows = []
    for r in range(N_ELECTRODES):
        skip = {(r - 1) % N_ELECTRODES, r, (r + 1) % N_ELECTRODES}
        rows.append([c for c in range(N_ELECTRODES) if c not in skip])
    return torch.tensor(rows)


EIM_COLUMNS = eim_columns()


def to_eim(voltages: torch.Tensor) -> torch.Tensor:
    """(..., 16, 13) readings -> (..., 16, 16) EIM with zeros at the skipped columns."""
    eim = voltages.new_zeros(*voltages.shape[:-1], N_ELECTRODES)
    return eim.scatter(-1, EIM_COLUMNS.to(voltages.device).expand(voltages.shape), voltages)


def normalise_voltages(ys: np.ndarray, mean: torch.Tensor, std: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """(..., 208, 1) raw voltages -> (..., 1, 16, 16) normalised EIM (one sample or a batch)."""
    ys = np.asarray(ys, dtype=np.float32)
    readings = torch.from_numpy(ys.reshape(*ys.shape[:-2], 1, N_ELECTRODES, N_PER_DRIVE))
    return to_eim((readings / scale - mean) / std)


# ------------------------------------------------------------------ paths
def resolve_data_root(path: str | Path | None, job: str = "cdeit") -> Path:
    """``path`` if it exists, else ``./data/<job>`` with a warning, else one error naming both."""
    given = Path(path) if path else None
    if given is not None and given.exists():
        return given
    fallback = Path("data") / job
    if fallback.exists():
        if given is not None:
            warnings.warn(f"data path {str(given)!r} does not exist; using {str(fallback)!r}", stacklevel=2)
        return fallback
    named = f"{str(given)!r} nor " if given is not None else ""
    raise ValueError(
        f"no {job} data: neither {named}{str(fallback)!r} exists; pass --data-path DIR "
        f"or run `raytpu data synth {job} --out {given or fallback}`"
    )


def find_stats(root: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean.pth`` / ``std.pth`` from the data root, else from ``./data``; float32 (1, 16, 13)."""
    places = [Path(root), Path("data")]
    for place in places:
        if (place / "mean.pth").is_file() and (place / "std.pth").is_file():
            return load_stat(place / "mean.pth"), load_stat(place / "std.pth")
    looked = " and ".join(repr(str(p)) for p in places)
    raise FileNotFoundError(
        f"normalisation statistics mean.pth / std.pth not found in {looked}; "
        f"compute them with `raytpu data stats cdeit --data-path {root}`"
    )


def load_stat(path: Path) -> torch.Tensor:
    """One statistics file: a tensor of 208 values, as (1, 16, 13) float32."""
    try:
        value = torch.load(path, weights_only=True)
        return value.float().reshape(1, N_ELECTRODES, N_PER_DRIVE)
    except Exception as exc:  # a corrupt or foreign file: torch, pickle and shape errors alike
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ValueError(
            f"{path}: not a statistics tensor of {N_ELECTRODES * N_PER_DRIVE} values ({reason}); "
            f"recompute it with `raytpu data stats cdeit --data-path {path.parent}`"
        ) from exc


# ------------------------------------------------------------------ dataset
class EITDataset(Dataset):
    """Items ``{"x": (1,S,S) xs, "y": (1,16,16) EIM, "tr": (1,S,S) TR}``, float32, files in name order."""

    def __init__(
        self, root: str | Path, split: str, mean: torch.Tensor, std: torch.Tensor, voltage_scale: float = 1.0
    ) -> None:
        self.folder = Path(root) / split
        self.files = sorted(self.folder.glob("*.npz"))
        if not self.files:
            raise FileNotFoundError(f"no .npz samples in {str(self.folder)!r}")
        self.mean, self.std, self.voltage_scale = mean, std, voltage_scale

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        path = self.files[index]
        try:
            with np.load(path) as sample:
                return {
                    "x": torch.from_numpy(sample["xs"].astype(np.float32))[None],
                    "y": normalise_voltages(sample["ys"], self.mean, self.std, self.voltage_scale),
                    "tr": torch.from_numpy(sample["TR"].astype(np.float32))[None],
                }
        except (OSError, ValueError, KeyError, RuntimeError, zipfile.BadZipFile) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ValueError(f"{path}: not a readable CDEIT sample (.npz with xs, ys, TR): {reason}") from exc

    def image_size(self) -> int:
        return int(self[0]["x"].shape[-1])


def eval_dataset(root: str | Path, name: str, mean: torch.Tensor, std: torch.Tensor) -> EITDataset:
    """The ``simulated`` (``<root>/test``), ``uef2017`` or ``ktc2023`` evaluation set."""
    if name not in EVAL_SETS:
        raise ValueError(f"unknown CDEIT eval set {name!r}; choose one of {', '.join(EVAL_SETS)}")
    folder, scale = EVAL_SETS[name]
    if not (Path(root) / folder).is_dir():
        raise FileNotFoundError(
            f"eval set {name!r} expects its .npz files in {str(Path(root) / folder)!r}, which does not exist; "
            f"pass --data-path to the folder that holds {folder}/"
        )
    return EITDataset(root, folder, mean, std, voltage_scale=scale)
