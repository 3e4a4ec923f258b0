"""``raytpu export``: a checkpoint's weights in the format the job's ecosystem loads (on the CPU)."""

from __future__ import annotations

from pathlib import Path

from raytpu import checkpoint as ckpt
from raytpu.config import Config, ConfigError
from raytpu.job import Job


def export(cfg: Config, job: Job, checkpoint: str, out: str) -> Path:
    """Build the job's model, load ``checkpoint`` (its EMA weights when it has them) and let the job
    write it to ``out``; the data root holds what travels with the model (a tokenizer)."""
    from raytpu.launcher import resolve_data_root

    if not checkpoint:
        raise ConfigError("export needs --checkpoint PATH (a checkpoint folder or weights file)")
    if not out:
        raise ConfigError(f"export needs --out DIR, e.g. --out exports/{job.name}")
    ckpt.check_weights(checkpoint)
    data_root = resolve_data_root(cfg, job, synthesize=False)
    model = job.build_model(cfg)
    model.load_state_dict(ckpt.load_model_weights(checkpoint), strict=True)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    job.export(model.eval(), cfg, data_root, target)
    return target
