"""Does the small config of each job learn, on every seed? Measured as a user runs it.

For each job and seed: ``raytpu train jobs/<job>/small.yaml run.seed=K`` on a fresh data set
made with seed K (``data.synthesize_if_missing``), then ``raytpu test`` on the best checkpoint,
both through the real ``raytpu`` executable (local Ray, the config's workers). Each job's table
puts the model beside its baselines on the same test data: an all-background prediction for
MSHNet (whose small config trains through its warm-up switch); the all-zeros image, the one-step
Tikhonov reconstruction ``TR`` and the model's posterior mean (one sampling step: ``mean/rmse``)
for CDEIT; the unigram perplexity (token frequencies of the train split) for the causal LM.
The last line always holds every key (``nan`` for a job left out)::

    worst_mshnet_mIoU=<lowest test mIoU> cdeit_rmse_over_tr=<worst RMSE / TR RMSE> lm_over_unigram=<worst ratio>

    python bench/learning.py [--jobs mshnet,cdeit,causal_lm] [--seeds 0,1,...] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raytpu.config import load_config  # noqa: E402

RAYTPU = str(Path(sys.executable).with_name("raytpu"))
CONFIGS = {
    "mshnet": "jobs/mshnet/small.yaml",
    "cdeit": "jobs/cdeit/small.yaml",
    "causal_lm": "jobs/causal_lm/small.yaml",
}
DEFAULT_SEEDS = {"mshnet": [0, 1, 2, 3, 4], "cdeit": [0, 1], "causal_lm": [0, 1, 2]}


def run(command: list[str]) -> tuple[str, float]:
    """Run a raytpu command from the repository root; its stdout and wall time (fails loudly)."""
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, time.monotonic() - start


def train_and_test(job: str, seed: int, workdir: Path) -> dict:
    where = [f"run.seed={seed}", f"data.path={workdir / 'data' / f'{job}-{seed}'}"]
    where += [f"run.storage_path={workdir / 'results'}", f"run.name={job}-small-{seed}", "logging.progress_bar=false"]
    out, train_s = run([RAYTPU, "train", CONFIGS[job], *where])
    best = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("best checkpoint:"))
    if job == "causal_lm":  # its test split is held-out text: the best evaluation's perplexity
        metrics = json.loads(
            next(line for line in out.splitlines() if line.startswith("final metrics:")).split(":", 1)[1]
        )
        return {"seed": seed, "train_s": train_s, **metrics, **baselines(job, where)}
    extra = ["--data", "simulated"] if job == "cdeit" else []
    out, test_s = run([RAYTPU, "test", CONFIGS[job], *where, "--checkpoint", best, *extra])
    metrics = json.loads(out.strip().splitlines()[-1])
    if job == "cdeit":  # the posterior mean: one sampling step from pure noise
        out, _ = run([RAYTPU, "test", CONFIGS[job], *where, "--checkpoint", best, *extra, "job.sampling_steps=1"])
        metrics["mean/rmse"] = json.loads(out.strip().splitlines()[-1])["test/rmse"]
    return {"seed": seed, "train_s": train_s, "test_s": test_s, **metrics, **baselines(job, where)}


def baselines(job: str, overrides: list[str]) -> dict:
    """The trivial predictions' scores on the same test images."""
    cfg, job_module = load_config(CONFIGS[job], overrides)
    root = Path(cfg.data.path)
    test = job_module.build_dataset(cfg, "test", root)
    items = [test[i] for i in range(len(test))]
    if job == "causal_lm":
        from raytpu.jobs.causal_lm import corpus

        train, valid = corpus.read_tokens(root, "train"), corpus.read_tokens(root, "valid")
        return {"unigram/perplexity": corpus.unigram_perplexity(train, valid, corpus.vocabulary_size(root))}
    if job == "mshnet":
        from raytpu.jobs.mshnet import metrics

        masks = torch.stack([item["mask"] for item in items])
        totals = metrics.batch_stats(torch.full_like(masks, -20.0), masks, cfg.job.legacy_fa)
        return {f"background/{k}": v for k, v in metrics.finish(totals).items()}
    from raytpu.jobs.cdeit import reconstruction_metrics

    truth = torch.stack([item["x"] for item in items])
    tikhonov = torch.stack([item["tr"] for item in items])
    return {
        "zeros/rmse": reconstruction_metrics(truth, torch.zeros_like(truth))["rmse"],
        "TR/rmse": reconstruction_metrics(truth, tikhonov)["rmse"],
    }


def table(job: str, rows: list[dict]) -> str:
    if job == "mshnet":
        columns = ["seed", "test/mIoU", "test/nIoU", "test/Pd", "test/Fa", "background/mIoU", "background/Pd"]
        columns.append("train_s")
    elif job == "causal_lm":
        columns = ["seed", "valid/perplexity", "unigram/perplexity", "over_unigram", "train_s"]
        for row in rows:
            row["over_unigram"] = row["valid/perplexity"] / row["unigram/perplexity"]
    else:
        columns = ["seed", "test/rmse", "mean/rmse", "test/psnr", "zeros/rmse", "TR/rmse", "rmse/TR", "train_s"]
        for row in rows:
            row["rmse/TR"] = row["test/rmse"] / row["TR/rmse"]
    lines = [" | ".join(columns)]
    for row in rows:
        lines.append(" | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in columns))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="mshnet,cdeit,causal_lm", help="comma-separated: mshnet, cdeit, causal_lm")
    parser.add_argument("--seeds", default="", help="comma-separated seeds for every job (default: per job)")
    parser.add_argument("--workdir", default="", help="where data and runs go (default: a new temporary folder)")
    args = parser.parse_args()
    jobs = [job for job in args.jobs.split(",") if job]
    unknown = sorted(set(jobs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown job(s) {unknown}; choose from {sorted(CONFIGS)}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="raytpu-learning-"))
    print(f"workdir {workdir}", flush=True)
    worst = {job: float("nan") for job in CONFIGS}
    for job in jobs:
        seeds = [int(s) for s in args.seeds.split(",") if s] or DEFAULT_SEEDS[job]
        rows = []
        for seed in seeds:
            rows.append(train_and_test(job, seed, workdir))
            print(f"{job} seed {seed}: {json.dumps(rows[-1])}", flush=True)
        print(f"\n{job} (small config, test split, one fresh data set per seed)\n{table(job, rows)}\n", flush=True)
        if job == "mshnet":
            worst[job] = min(row["test/mIoU"] for row in rows)
        elif job == "causal_lm":
            worst[job] = max(row["over_unigram"] for row in rows)
        else:
            worst[job] = max(row["test/rmse"] / row["TR/rmse"] for row in rows)
    print(
        f"worst_mshnet_mIoU={worst['mshnet']:.4f} cdeit_rmse_over_tr={worst['cdeit']:.4f} "
        f"lm_over_unigram={worst['causal_lm']:.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
