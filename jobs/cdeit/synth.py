"""Simulated EIT data in CDEIT's layout, made with pyEIT (FEM, 16 electrodes, adjacent drive and measurement).

Each sample: random inclusions (circles, semicircles, annuli) with a
conductivity change of about +-1 on a zero background inside the unit disk,
difference voltages dv = v(1 + change) - v(1) with 40 dB noise (208 readings),
and two one-step linearised reconstructions on the SxS grid: ``TR``
(Tikhonov, identity prior) and ``xs_gn`` (one-step Gauss-Newton, NOSER prior).

Every sample's RNG is derived from (seed, split, index), so a seed gives the
same arrays whatever the number of processes.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyeit.eit.protocol as protocol
import pyeit.mesh as pyeit_mesh
import scipy.sparse as sp
import torch
from pyeit.eit.fem import EITForward

N_ELECTRODES = 16
N_READINGS = 208  # 16 drives x 13 adjacent measurements
SPLITS = ("train", "valid", "test")
SNR_DB = 40.0
MESH_H0 = 0.1  # coarse distmesh (376 nodes, 686 triangles): ~30 ms per forward solve
TIKHONOV_LAMBDA = 1e-2  # relative to the mean diagonal of J^T J
NOSER_LAMBDA = 1e-2
MIN_TASKS_PER_PROCESS = 16  # below this a process costs more to start than it saves


# ------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Inclusion:
    kind: str  # circle | semicircle | annulus
    cx: float
    cy: float
    radius: float
    inner: float = 0.0  # annulus hole radius
    angle: float = 0.0  # semicircle: direction of the kept half
    value: float = 1.0

    def mask(self, points: np.ndarray) -> np.ndarray:
        dx, dy = points[:, 0] - self.cx, points[:, 1] - self.cy
        dist = np.hypot(dx, dy)
        inside = dist <= self.radius
        if self.kind == "annulus":
            inside &= dist >= self.inner
        elif self.kind == "semicircle":
            inside &= dx * np.cos(self.angle) + dy * np.sin(self.angle) >= 0
        return inside


def random_inclusions(rng: np.random.Generator, max_count: int = 3) -> list[Inclusion]:
    """1..max_count inclusions inside the disk of radius 0.9, change +U(0.7,1) or -U(0.7,0.95)."""
    shapes = []
    for _ in range(int(rng.integers(1, max_count + 1))):
        kind = ("circle", "semicircle", "annulus")[int(rng.integers(0, 3))]
        radius = float(rng.uniform(0.12, 0.3) if kind == "circle" else rng.uniform(0.18, 0.35))
        distance = float(rng.uniform(0.0, 0.9 - radius))
        direction = float(rng.uniform(0, 2 * np.pi))
        value = float(rng.uniform(0.7, 1.0)) if rng.random() < 0.5 else -float(rng.uniform(0.7, 0.95))
        shapes.append(
            Inclusion(
                kind=kind,
                cx=distance * np.cos(direction),
                cy=distance * np.sin(direction),
                radius=radius,
                inner=radius * float(rng.uniform(0.4, 0.7)),
                angle=float(rng.uniform(0, 2 * np.pi)),
                value=value,
            )
        )
    return shapes


def paint(points: np.ndarray, inclusions: list[Inclusion]) -> np.ndarray:
    """Conductivity change at ``points`` (later inclusions drawn over earlier ones)."""
    values = np.zeros(len(points))
    for inclusion in inclusions:
        values[inclusion.mask(points)] = inclusion.value
    return values


def pixel_centers(size: int) -> np.ndarray:
    """(size*size, 2) xy of the pixel centres, row-major, row 0 at the top (y = +1)."""
    coords = -1.0 + (np.arange(size) + 0.5) * 2.0 / size
    xx, yy = np.meshgrid(coords, coords[::-1])
    return np.stack([xx.ravel(), yy.ravel()], axis=1)


# ------------------------------------------------------------------ FEM setup
def build_mesh(h0: float = MESH_H0) -> pyeit_mesh.PyEITMesh:
    """distmesh of the unit disk with 16 point electrodes; distmesh's global-RNG use is seeded and restored."""
    state = np.random.get_state()
    np.random.seed(0)
    try:
        return pyeit_mesh.create(N_ELECTRODES, h0=h0)
    finally:
        np.random.set_state(state)


def barycentric_map(mesh: pyeit_mesh.PyEITMesh, points: np.ndarray, chunk: int = 1024) -> sp.csr_matrix:
    """Sparse (points x nodes) linear interpolation on the mesh; points off the mesh use the nearest triangle."""
    nodes, tri = mesh.node[:, :2], mesh.element
    a, b, c = nodes[tri[:, 0]], nodes[tri[:, 1]], nodes[tri[:, 2]]
    det = (b[:, 1] - c[:, 1]) * (a[:, 0] - c[:, 0]) + (c[:, 0] - b[:, 0]) * (a[:, 1] - c[:, 1])
    rows, cols, vals = [], [], []
    for start in range(0, len(points), chunk):
        p = points[start : start + chunk, None, :]
        l1 = ((b[:, 1] - c[:, 1]) * (p[..., 0] - c[:, 0]) + (c[:, 0] - b[:, 0]) * (p[..., 1] - c[:, 1])) / det
        l2 = ((c[:, 1] - a[:, 1]) * (p[..., 0] - c[:, 0]) + (a[:, 0] - c[:, 0]) * (p[..., 1] - c[:, 1])) / det
        lam = np.stack([l1, l2, 1.0 - l1 - l2], axis=-1)
        best = lam.min(axis=-1).argmax(axis=1)
        weights = np.clip(lam[np.arange(len(best)), best], 0.0, None)
        weights /= weights.sum(axis=1, keepdims=True)
        rows.append(np.repeat(np.arange(start, start + len(best)), 3))
        cols.append(tri[best].ravel())
        vals.append(weights.ravel())
    shape = (len(points), len(nodes))
    return sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=shape)


def element_to_node(mesh: pyeit_mesh.PyEITMesh) -> sp.csr_matrix:
    """Sparse (nodes x elements) area-weighted averaging of element values onto nodes."""
    nodes, tri = mesh.node[:, :2], mesh.element
    d1, d2 = nodes[tri[:, 1]] - nodes[tri[:, 0]], nodes[tri[:, 2]] - nodes[tri[:, 0]]
    area = 0.5 * np.abs(d1[:, 0] * d2[:, 1] - d1[:, 1] * d2[:, 0])
    cols = np.repeat(np.arange(len(tri)), 3)
    matrix = sp.csr_matrix((np.repeat(area, 3), (tri.ravel(), cols)), shape=(len(nodes), len(tri)))
    return sp.diags(1.0 / np.asarray(matrix.sum(axis=1)).ravel()) @ matrix


class Simulator:
    """Per-process FEM model: forward solver, reference voltages and the two reconstruction operators."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mesh = build_mesh()
        self.fwd = EITForward(self.mesh, protocol.create(N_ELECTRODES, dist_exc=1, step_meas=1, parser_meas="std"))
        self.centers = self.mesh.elem_centers[:, :2]
        self.pixels = pixel_centers(size)
        self.inside = np.hypot(self.pixels[:, 0], self.pixels[:, 1]) <= 1.0
        jac, self.v0 = self.fwd.compute_jac(perm=1.0)
        to_image = barycentric_map(self.mesh, self.pixels) @ element_to_node(self.mesh)
        to_image = sp.diags(self.inside.astype(float)) @ to_image
        jtj = jac.T @ jac
        tikhonov = TIKHONOV_LAMBDA * np.mean(np.diag(jtj)) * np.eye(len(jtj))
        noser = NOSER_LAMBDA * np.diag(np.diag(jtj))
        # pyEIT's sign convention: the change of conductivity is -H dv
        self.tr_operator = -(to_image @ np.linalg.solve(jtj + tikhonov, jac.T))
        self.gn_operator = -(to_image @ np.linalg.solve(jtj + noser, jac.T))

    def sample(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        inclusions = random_inclusions(rng)
        v1 = self.fwd.solve_eit(1.0 + paint(self.centers, inclusions))
        dv = v1 - self.v0
        dv = dv + rng.standard_normal(dv.shape) * np.sqrt(np.mean(dv**2)) * 10 ** (-SNR_DB / 20)
        xs = np.where(self.inside, paint(self.pixels, inclusions), 0.0)
        image = (self.size, self.size)
        return {
            "xs": xs.reshape(image).astype(np.float32),
            "ys": dv.reshape(N_READINGS, 1).astype(np.float32),
            "xs_gn": (self.gn_operator @ dv).reshape(image).astype(np.float32),
            "TR": (self.tr_operator @ dv).reshape(image).astype(np.float32),
        }


@lru_cache(maxsize=2)
def simulator(size: int) -> Simulator:
    return Simulator(size)


# ------------------------------------------------------------------ driver
def sample_rng(seed: int, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, SPLITS.index(split), index])


def make_sample(size: int, seed: int, split: str, index: int) -> dict[str, np.ndarray]:
    """One sample, a pure function of its arguments."""
    return simulator(size).sample(sample_rng(seed, split, index))


def _write(task: tuple[Path, int, int, str, int]) -> None:
    out, size, seed, split, index = task
    np.savez(out / split / f"{index:06d}.npz", **make_sample(size, seed, split, index))


def _tasks(out: Path, counts: dict[str, int], size: int, seed: int) -> Iterator[tuple[Path, int, int, str, int]]:
    for split, count in counts.items():
        for index in range(count):
            yield out, size, seed, split, index


def synthesize(
    out: Path,
    n_train: int = 64,
    n_valid: int = 16,
    n_test: int = 16,
    size: int = 32,
    seed: int = 0,
    processes: int | None = None,
) -> Path:
    """Write ``out/{train,valid,test}/NNNNNN.npz`` and ``out/mean.pth``, ``out/std.pth``.

    ``processes``: worker processes (default: every core, at most one per
    16 samples); the arrays do not depend on it.
    """
    if n_train < 2:
        raise ValueError(f"n_train must be at least 2 to compute std.pth, got {n_train}")
    out = Path(out)
    counts = {"train": n_train, "valid": n_valid, "test": n_test}
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    tasks = list(_tasks(out, counts, size, seed))
    workers = max(1, min(processes or os.cpu_count() or 1, -(-len(tasks) // MIN_TASKS_PER_PROCESS)))
    if workers == 1:
        for task in tasks:
            _write(task)
    else:
        with ProcessPoolExecutor(workers, mp_context=_context(size)) as pool:
            list(pool.map(_write, tasks, chunksize=max(1, len(tasks) // (4 * workers))))
    compute_stats(out)
    return out


def _context(size: int) -> multiprocessing.context.BaseContext:
    """fork where available (workers inherit the FEM set-up built here; they run no torch code), else spawn."""
    if "fork" in multiprocessing.get_all_start_methods():
        simulator(size)
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")


def compute_stats(root: Path | str) -> dict[str, object]:
    """Recompute ``mean.pth`` / ``std.pth`` (float32, (1,16,13)) from ``root/train/*.npz``."""
    root = Path(root)
    files = sorted((root / "train").glob("*.npz"))
    if len(files) < 2:
        raise ValueError(f"need at least 2 training samples in {root / 'train'} to compute statistics")
    ys = np.stack([np.load(f)["ys"][:, 0] for f in files]).astype(np.float64).reshape(-1, 1, 16, 13)
    mean = torch.from_numpy(ys.mean(axis=0)).float()
    std = torch.from_numpy(ys.std(axis=0, ddof=1)).float()
    torch.save(mean, root / "mean.pth")
    torch.save(std, root / "std.pth")
    return {"samples": len(files), "mean": str(root / "mean.pth"), "std": str(root / "std.pth")}
