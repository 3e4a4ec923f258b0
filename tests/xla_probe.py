"""Run the raytpu loop in-process on the XLA CPU device and report compiles after warm-up.

Used by tests in a subprocess (torch_xla reads PJRT_DEVICE / CPU_NUM_DEVICES once
per process). Usage: python -m tests.xla_probe WARMUP_STEPS OVERRIDE... ; prints one
JSON line: compiles and fallback counters seen after the warm-up steps, and the losses.
With ``data.loader=ray`` the batches come from the prepared tables through a local
Ray instance started here, as a Ray Train worker would read its dataset shard.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch_xla
import torch_xla.debug.metrics as met

from raytpu.config import load_config
from raytpu.launcher import resolve_data_root
from raytpu.loop import LocalReporter, Trainer
from raytpu.runtime import make_runtime


def ray_datasets(cfg, job) -> dict | None:
    """Split -> Ray DataIterator when the config reads through Ray Data, else None."""
    if cfg.data.loader != "ray":
        return None
    import ray

    from raytpu import ingest

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return {split: data.iterator() for split, data in ingest.read_datasets(cfg, job, "train").items()}


def main(argv: list[str]) -> None:
    warmup, overrides = int(argv[0]), argv[1:]
    cfg, job = load_config(None, ["logging.progress_bar=false", *overrides])
    runtime = make_runtime("xla", cfg.scaling.precision, 1, 0, 0, cfg.xla)
    run_dir = Path(tempfile.mkdtemp(prefix="xla-probe-"))
    data_root = resolve_data_root(cfg, job) if cfg.data.path else run_dir
    trainer = Trainer(cfg, job, runtime, run_dir, data_root, LocalReporter(run_dir), ray_datasets(cfg, job))
    seen: dict = {"losses": []}
    train_step, after_step = trainer._train_step, trainer._after_step
    log_closure = trainer._log_closure
    job_train_step = job.train_step

    def compiles() -> int:
        data = met.metric_data("CompileTime")
        return data[0] if data else 0

    def probe_train_step(batches) -> None:
        seen["before"] = compiles()
        train_step(batches)

    def probe_after_step() -> None:
        """Compiles of the step and its closures only: what a checkpoint between
        steps compiles (FSDPv2 gathers each sharded tensor once) is not the step's."""
        after_step()
        step = trainer.progress.step
        if step == warmup:
            met.clear_all()
        elif step > warmup:
            seen[step] = {
                "compiles": compiles() - seen["before"],
                "fallbacks": sorted(n for n in met.counter_names() if n.startswith("aten::")),
            }

    def probe_job_step(model, batch, ctx):
        """The sharding of the first batch tensor as the step receives it ('' = replicated)."""
        first = next(value for value in batch.values() if isinstance(value, torch.Tensor))
        seen.setdefault("input_sharding", torch_xla._XLAC._get_xla_sharding_spec(first))
        return job_train_step(model, batch, ctx)

    def probe_log(stats, step, lr) -> None:
        seen["losses"].append(float(stats.cpu()[0]))
        log_closure(stats, step, lr)

    trainer._train_step = probe_train_step
    trainer._after_step = probe_after_step
    trainer.evaluate = lambda *args, **kwargs: {}  # eval graphs are not part of the training step
    trainer._log_closure = probe_log
    job.train_step = probe_job_step
    trainer.fit()
    steps = [k for k in seen if isinstance(k, int)]
    print(
        json.dumps(
            {
                "devices": runtime.local_devices,
                "compiles_after_warmup": sum(seen[s]["compiles"] for s in steps),
                "fallbacks_after_warmup": sorted({f for s in steps for f in seen[s]["fallbacks"]}),
                "steps_checked": len(steps),
                "losses": seen["losses"],
                "input_sharding": seen.get("input_sharding"),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
