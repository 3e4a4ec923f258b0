"""CDEIT's test mode (the 5-step DDIM-EIT sampler) on the XLA CPU device: how many
graphs it compiles. Usage: python -m tests.xla_sampler_probe DATA_ROOT RUN_DIR BATCH [OVERRIDE...];
prints one JSON line with the compiles of a first and a second full test pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch_xla
import torch_xla.debug.metrics as met

from raytpu.config import load_config


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def main(data_root: str, run_dir: str, batch: str, *overrides: str) -> None:
    cfg, job = load_config(
        "jobs/cdeit/small.yaml",
        [f"data.path={data_root}", f"data.global_batch_size={batch}", "job.test_images=4", *overrides],
    )
    model = job.build_model(cfg).to(torch_xla.device())
    counts = []
    for attempt in range(2):
        before = compiles()
        metrics = job.test(model, cfg, Path(run_dir) / str(attempt), Path(data_root))
        counts.append(compiles() - before)
    print(json.dumps({"compiles_per_pass": counts, "rmse": metrics["rmse"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
