"""CDEIT (conditional diffusion transformer for electrical impedance tomography) as a raytpu job.

Training: x0-predicting diffusion with an L1 loss at uniform timesteps (Adam
lr 1e-5, clip 1.0 and the EMA of the weights, beta 0.995 every 10 steps, come
from the config: ``optim``, ``loop.clip_grad_norm``, ``loop.ema_beta`` /
``loop.ema_every``). Validation: L1 at random timesteps. Test: the DDIM-EIT
sampler on ``simulated``, ``uef2017`` or ``ktc2023``, RMSE and PSNR.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Dataset

from raytpu.job import Batch, BatchDecoder, Columns, Job, JobConfig, StepContext
from raytpu.jobs.cdeit import synth
from raytpu.jobs.cdeit.data import (
    EVAL_SETS,
    EITDataset,
    eval_dataset,
    find_stats,
    normalise_voltages,
    resolve_data_root,
)
from raytpu.jobs.cdeit.diffusion import Diffusion, pixel_errors
from raytpu.jobs.cdeit.model import DiT, DiTConfig, training_flops

DIFFUSION = Diffusion()
LOSSES = ("l1", "mse")


@dataclass(frozen=True)
class CDEITConfig(JobConfig):
    name: str = "cdeit"
    image_size: int = 128
    patch_size: int = 2
    hidden_size: int = 512
    num_heads: int = 16
    window_size: int = 0  # 0: a quarter of the token grid (the original)
    scales: int = 4  # down / up stages of the U
    stage_depth: int = 2  # blocks per stage
    window_depth: int = 2  # windowed-attention blocks at the input and the output
    sampling_steps: int = 5
    # training loss on the x0 prediction: "l1" (the authors') or "mse"; valid/val_loss is the same error
    loss: str = "l1"
    eval_set: str = "simulated"  # simulated | uef2017 | ktc2023 (test mode)
    test_images: int = 32  # PNGs (truth | TR | prediction) written by test mode
    synth_n_train: int = 64
    synth_n_valid: int = 16
    synth_n_test: int = 16


def model_config(job: CDEITConfig) -> DiTConfig:
    return DiTConfig(
        image_size=job.image_size,
        patch_size=job.patch_size,
        hidden_size=job.hidden_size,
        num_heads=job.num_heads,
        window_size=job.window_size,
        scales=job.scales,
        stage_depth=job.stage_depth,
        window_depth=job.window_depth,
    )


# ------------------------------------------------------------------ metrics and images
def reconstruction_metrics(truth: torch.Tensor, prediction: torch.Tensor) -> dict[str, float]:
    """RMSE over all pixels; PSNR per image after mapping [-1,1] -> [0,1], peak = the truth image's max."""
    truth, prediction = truth.double().flatten(1), prediction.double().flatten(1)
    rmse_image = (truth - prediction).square().mean(1).sqrt()
    truth01, prediction01 = truth / 2 + 0.5, prediction / 2 + 0.5
    mse01 = (truth01 - prediction01).square().mean(1)
    psnr = 10 * torch.log10(truth01.amax(1).square() / (mse01 + 1e-12))
    return {
        "rmse": float((truth - prediction).square().mean().sqrt()),
        "rmse_image_std": float(rmse_image.std()) if len(rmse_image) > 1 else 0.0,
        "psnr": float(psnr.mean()),
        "psnr_std": float(psnr.std()) if len(psnr) > 1 else 0.0,
        "images": float(len(psnr)),
    }


def panel(truth: torch.Tensor, tr: torch.Tensor, prediction: torch.Tensor) -> torch.Tensor:
    """(N,1,S,3S) in [0,1]: truth | TR (scaled by its max |value|) | prediction."""
    tr_scale = tr.abs().amax(dim=(1, 2, 3), keepdim=True).clamp_min(1e-12)
    parts = [truth / 2 + 0.5, tr / tr_scale / 2 + 0.5, prediction.float() / 2 + 0.5]
    return torch.cat(parts, dim=3).clamp(0, 1)


def save_panels(images: torch.Tensor, folder: Path, prefix: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pixels = (images[:, 0].cpu().numpy() * 255).round().astype(np.uint8)
    for index, image in enumerate(pixels):
        Image.fromarray(image).save(folder / f"{prefix}_{index:04d}.png")


def padded(batch: Batch, size: int) -> Batch:
    """Repeat the last item so every batch has ``size`` items (fixed shapes for XLA)."""
    missing = size - len(batch["x"])
    return {k: torch.cat([v, v[-1:].expand(missing, *v.shape[1:])]) if missing else v for k, v in batch.items()}


# ------------------------------------------------------------------ job
class CDEITJob(Job):
    name = "cdeit"
    config_class = CDEITConfig
    main_metric = "val_loss"
    main_metric_mode = "min"
    aliases = {
        "--mode": "run.mode",
        "--data": "job.eval_set",
        "--data-path": "data.path",
        "--results-dir": "run.storage_path",
        "--global-batch-size": "data.global_batch_size",
        "--epochs": "loop.epochs",
        "--global-seed": "run.seed",
        "--num-workers": "data.num_workers",
        "--log-every": "loop.log_every",
        "--ckpt-every": "checkpoint.every_steps",
        "--samplingsteps": "job.sampling_steps",
    }

    # ----------------------------------------------------------------- build
    def check_config(self, cfg: Any) -> None:
        try:
            model_config(cfg.job).validate()
        except ValueError as exc:
            raise ValueError(f"job (CDEIT model settings): {exc}") from exc
        if cfg.job.eval_set not in EVAL_SETS:
            raise ValueError(f"job.eval_set={cfg.job.eval_set!r} is not one of {', '.join(EVAL_SETS)}")
        if cfg.job.loss not in LOSSES:
            raise ValueError(f"job.loss={cfg.job.loss!r} is not one of {', '.join(LOSSES)}")
        if cfg.job.sampling_steps < 1:
            raise ValueError(f"job.sampling_steps must be at least 1, got {cfg.job.sampling_steps}")

    def build_model(self, cfg: Any) -> nn.Module:
        return DiT(model_config(cfg.job))

    def build_dataset(self, cfg: Any, split: str, data_root: Path) -> Dataset:
        mean, std = find_stats(data_root)
        if split == "test":
            dataset = eval_dataset(data_root, cfg.job.eval_set, mean, std)
        else:
            dataset = EITDataset(data_root, split, mean, std)
        if dataset.image_size() != cfg.job.image_size:
            raise ValueError(
                f"{dataset.folder} holds {dataset.image_size()}x{dataset.image_size()} images but "
                f"job.image_size is {cfg.job.image_size}; set job.image_size to match the data"
            )
        return dataset

    synthesize = staticmethod(synth.synthesize)

    def synth_options(self, cfg: Any) -> dict[str, Any]:
        job = cfg.job
        return {
            "n_train": job.synth_n_train,
            "n_valid": job.synth_n_valid,
            "n_test": job.synth_n_test,
            "size": job.image_size,
            "seed": cfg.run.seed,
        }

    def compute_stats(self, root: Path) -> dict[str, Any]:
        """``raytpu data stats cdeit``: rewrite mean.pth / std.pth from the train split."""
        return synth.compute_stats(root)

    # ---------------------------------------------------- tables (data.loader=ray)
    rows_per_file = 1024
    stats_files = ("mean.pth", "std.pth")

    def table_names(self, src: Path) -> list[str]:
        """Every split folder of .npz samples: train, valid, test and the real eval sets present."""
        folders = ["train", "valid"] + [folder for folder, _ in EVAL_SETS.values()]
        return [name for name in folders if any((Path(src) / name).glob("*.npz"))]

    def table_for_split(self, cfg: Any, split: str) -> str:
        return EVAL_SETS[cfg.job.eval_set][0] if split == "test" else split

    def table_records(self, src: Path, table: str, rows: int) -> Iterator[Columns]:
        """The .npz arrays as float32 (as :class:`EITDataset` reads them), in file-name order."""
        files = sorted((Path(src) / table).glob("*.npz"))
        for start in range(0, len(files), rows):
            chunk = files[start : start + rows]
            samples = [dict(np.load(f)) for f in chunk]
            keys = [k for k in ("xs", "ys", "xs_gn", "TR") if k in samples[0]]
            columns: Columns = {"id": np.arange(start, start + len(chunk), dtype=np.int64)}
            columns["name"] = [f.stem for f in chunk]
            columns.update({k: np.stack([s[k] for s in samples]).astype(np.float32) for k in keys})
            yield columns

    def batch_decoder(self, cfg: Any, split: str, stats_root: Path) -> BatchDecoder:
        """Arrays -> the :class:`EITDataset` items: x and TR as (n,1,S,S), the normalised EIM as (n,1,16,16)."""
        mean, std = find_stats(stats_root)
        scale = EVAL_SETS[cfg.job.eval_set][1] if split == "test" else 1.0

        def decode(columns: Columns, epoch: int) -> Batch:
            xs = np.asarray(columns["xs"], dtype=np.float32)
            if xs.shape[-1] != cfg.job.image_size:
                raise ValueError(
                    f"the prepared {split} table holds {xs.shape[-1]}x{xs.shape[-1]} images but job.image_size "
                    f"is {cfg.job.image_size}; set job.image_size to match the data"
                )
            return {
                "x": torch.from_numpy(xs)[:, None],
                "y": normalise_voltages(columns["ys"], mean, std, scale),
                "tr": torch.from_numpy(np.asarray(columns["TR"], dtype=np.float32))[:, None],
            }

        return decode

    # ------------------------------------------------------------ throughput
    def flops_per_sample(self, cfg: Any, model: nn.Module) -> float:
        """One denoiser forward and backward per training sample, counted by formula
        (:func:`raytpu.jobs.cdeit.model.training_flops`; the paper's model: 860 GFLOP, small.yaml 0.72). No tokens: an
        image is no sequence, so CDEIT's throughput is in samples/s."""
        return float(training_flops(model_config(cfg.job)))

    # ------------------------------------------------------------------ step
    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        x0 = batch["x"]
        t = DIFFUSION.sample_t(x0.shape[0], x0.device)
        loss = DIFFUSION.training_loss(model, x0, batch["y"], t, torch.randn_like(x0), ctx.config.job.loss)
        return loss, {"loss": loss}

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        """Per-image L1, squared error and training loss (``job.loss``) of the x0 prediction at
        random timesteps, summed."""
        x0 = batch["x"]
        t = DIFFUSION.sample_t(x0.shape[0], x0.device)
        prediction = model(DIFFUSION.q_sample(x0, t, torch.randn_like(x0)), t, batch["y"])
        errors = {kind: pixel_errors(prediction, x0, kind).flatten(1).mean(1) for kind in LOSSES}
        sums = {f"{kind}_sum": error.sum() for kind, error in errors.items()}
        return {**sums, "loss_sum": sums[f"{ctx.config.job.loss}_sum"], "count": torch.ones_like(errors["l1"]).sum()}

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """``val_loss`` (the main metric: the training loss's own error), ``val_l1`` and ``val_mse``."""
        count = totals["count"].clamp_min(1)
        return {f"val_{name}": float(totals[f"{name}_sum"] / count) for name in ("loss", *LOSSES)}

    def eval_images(self, model: nn.Module, batch: Batch, ctx: StepContext) -> dict[str, torch.Tensor]:
        steps = ctx.config.job.sampling_steps if ctx.config is not None else 5
        prediction = DIFFUSION.sample(model, batch["y"], tuple(batch["x"].shape), steps=steps)
        return {"truth_tr_prediction": panel(batch["x"], batch["tr"], prediction)}

    # ------------------------------------------------------------------ test
    @torch.no_grad()
    def test(self, model: nn.Module, cfg: Any, run_dir: Path, data_root: Path | None = None) -> dict[str, float]:
        """DDIM-EIT sampling on ``job.eval_set``; RMSE / PSNR; PNG panels under ``run_dir/test_<set>/``."""
        dataset = self.build_dataset(cfg, "test", data_root or resolve_data_root(cfg.data.path))
        size = cfg.data.eval_batch_size or cfg.data.global_batch_size
        loader = DataLoader(dataset, batch_size=size, shuffle=False, num_workers=cfg.data.num_workers)
        device = next(model.parameters()).device
        generator = torch.Generator().manual_seed(cfg.run.seed)
        model.eval()
        truths, predictions, panels = [], [], []
        for batch in loader:
            n, full = len(batch["x"]), padded(batch, size)
            y = full["y"].to(device)
            steps = cfg.job.sampling_steps
            prediction = DIFFUSION.sample(model, y, tuple(full["x"].shape), steps=steps, generator=generator)
            prediction = prediction.cpu()[:n]
            truths.append(batch["x"])
            predictions.append(prediction)
            panels.append(panel(batch["x"], batch["tr"], prediction))
        truth, prediction = torch.cat(truths), torch.cat(predictions)
        metrics = reconstruction_metrics(truth, prediction)
        folder = Path(run_dir) / f"test_{cfg.job.eval_set}"
        save_panels(torch.cat(panels)[: cfg.job.test_images], folder, cfg.job.eval_set)
        np.savez(folder / "predictions.npz", truth=truth.numpy(), prediction=prediction.numpy())
        (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics


JOB = CDEITJob()
