"""``raytpu export``: a checkpoint's weights in the format the job's ecosystem loads (on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raytpu.config import Config, ConfigError
from raytpu.job import Exports, Job
from raytpu.records import checkpoints as ckpt


def export(cfg: Config, job: Job, checkpoint: str, out: str) -> Path:
    """Build the job's model, load ``checkpoint`` (its EMA weights when it has them) and let the job
    write it to ``out``; the data root holds what travels with the model (a tokenizer)."""
    from raytpu.driver.preflight import resolve_data_root

    if not isinstance(job, Exports):
        raise ConfigError(f"job {job.name!r} has no export format: its checkpoints' model.safetensors are the weights")
    if not checkpoint:
        raise ConfigError("export needs --checkpoint PATH (a checkpoint folder or weights file)")
    if not out:
        raise ConfigError(f"export needs --out DIR, e.g. --out exports/{job.name}")
    ckpt.check_weights(checkpoint)
    data_root = resolve_data_root(cfg, job, synthesize=False)
    model = job.build_model(cfg)
    weights = ckpt.load_model_weights(checkpoint)
    mismatch = weights_mismatch(model.state_dict(), weights)
    if mismatch:
        raise ConfigError(f"{checkpoint} does not hold weights of this config's model: {mismatch}")
    model.load_state_dict(weights, strict=True)
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    job.export(model.eval(), cfg, data_root, target)
    return target


def weights_mismatch(expected: dict[str, Any], found: dict[str, Any]) -> str:
    """What differs between a model's state_dict and a checkpoint's weights, in a few words ("" = nothing)."""
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    reshaped = [key for key in expected if key in found and tuple(found[key].shape) != tuple(expected[key].shape)]
    parts = [f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []
    parts += [f"{len(unexpected)} unexpected (e.g. {unexpected[0]})"] if unexpected else []
    if reshaped:
        key = reshaped[0]
        shapes = f"{tuple(found[key].shape)} for {tuple(expected[key].shape)}"
        parts.append(f"{len(reshaped)} of another shape (e.g. {key}: {shapes})")
    return "; ".join(parts)
