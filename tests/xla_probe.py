"""Run the raytpu loop in-process on the XLA CPU device and report compiles after warm-up.

Used by tests in a subprocess (torch_xla reads PJRT_DEVICE / CPU_NUM_DEVICES once
per process). Usage: python -m tests.xla_probe WARMUP_STEPS OVERRIDE... [-- OVERRIDE...]...;
each ``--``-separated group is one run, in order, in this one process (runs whose step is
the same graph share XLA's in-memory compile cache); prints, before each run's first step, how the
model was prepared (a line marked ``PREPARED``), then one JSON line per run: compiles
and fallback counters seen after the warm-up steps, the losses, how the model was wrapped
(FSDPv2 units; modules under torch_xla's gradient checkpointing), the run folder and the
run's wall time. With ``data.loader=ray`` the batches come from the prepared tables through
Ray (the instance at ``RAY_ADDRESS``, else a local one started here), as a Ray Train worker
would read its dataset shard.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from raytpu.config import load_config
from raytpu.config.plan import resolve_config
from raytpu.driver.preflight import resolve_data_root
from raytpu.hooks import Callback
from raytpu.records import goodput
from raytpu.runtime import make_runtime, resolve_precision
from raytpu.runtime.xla import quiet_xla_logs
from raytpu.storage.run_folder import RunFolder
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import PREPARED, PROBE_RUNS

quiet_xla_logs()  # before torch_xla is imported, as raytpu's XLA runtime and every Ray worker's start do
import torch_xla  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402


def ray_datasets(cfg, job) -> dict | None:
    """Split -> Ray DataIterator when the config reads through Ray Data, else None."""
    if cfg.data.loader != "ray":
        return None
    import ray

    from raytpu.driver.ray_trainer import read_datasets

    if not ray.is_initialized() and os.environ.get("RAY_ADDRESS"):  # the tests' session instance
        ray.init(log_to_driver=False)
    elif not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    return {split: data.iterator() for split, data in read_datasets(cfg, job, "train").items()}


#: the weights whose sharding a report shows (a causal LM's)
SHOWN_WEIGHTS = ("layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight", "embed_tokens", "stacked__")


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def prepared(trainer) -> dict:
    """How the runtime wrapped and sharded the model."""
    modules = list(trainer.model.modules())
    shardings = {  # how the mesh holds a few weights ('' = replicated)
        name: torch_xla._XLAC._get_xla_sharding_spec(param)
        for name, param in trainer.runtime.unwrap(trainer.model).named_parameters()
        if any(part in name for part in SHOWN_WEIGHTS)
    }
    return {
        "shardings": shardings,
        "parameters": len(list(trainer.model.parameters())),
        "fsdp_wrappers": sum(type(m).__name__ == "SpmdFullyShardedDataParallel" for m in modules),
        "checkpointed_modules": sum("_xla_checkpointed_forward_original" in vars(m) for m in modules),
    }


class Probe(Callback):
    """Compiles and CPU fallbacks of each training step after ``warmup`` (the step and its log
    closures only: an eval or a checkpoint between steps, which compile graphs of their own,
    is not the step's), and the losses the log closures read back; before the first step, how the
    model was prepared (:data:`PREPARED`)."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.before = warmup, 0
        self.seen: dict = {"losses": [], "steps": {}}

    def on_step_start(self, trainer, step: int) -> None:
        if "prepared" not in self.seen:
            self.seen["prepared"] = prepared(trainer)
            print(PREPARED + json.dumps(self.seen["prepared"]), flush=True)
        self.before = compiles()

    def on_step_end(self, trainer, step: int) -> None:
        if step == self.warmup:
            met.clear_all()
        elif step > self.warmup:
            fallbacks = sorted(n for n in met.counter_names() if n.startswith("aten::"))
            self.seen["steps"][step] = {"compiles": compiles() - self.before, "fallbacks": fallbacks}

    def on_log(self, trainer, step: int, values: dict[str, float]) -> None:
        self.seen["losses"].append(values["loss"])


def main(argv: list[str]) -> None:
    warmup, runs = int(argv[0]), [[]]
    for word in argv[1:]:
        if word == "--":
            runs.append([])
        else:
            runs[-1].append(word)
    for overrides in runs:
        print(json.dumps(probe_run(warmup, overrides)), flush=True)


def probe_run(warmup: int, overrides: list[str]) -> dict:
    start = time.perf_counter()
    met.clear_all()
    cfg, job = load_config(None, ["logging.progress_bar=false", "logging.eval_images=0", *overrides])
    cfg = resolve_config(cfg, "xla", resolve_precision("xla", cfg.scaling.precision)[0])  # as planned
    runtime = make_runtime("xla", cfg.scaling.precision, 1, 0, 0, cfg.xla, sharding=cfg.sharding)
    # a named run (run.name given) is kept in run.storage_path, so that a later run of the same name resumes
    # it; an unnamed one gets a folder of its own in PROBE_RUNS (the suite's: tests/conftest.py), else in /tmp
    named = any(word.startswith("run.name=") for word in overrides)
    if named:
        run_dir = Path(cfg.run.storage_path) / cfg.run.name
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="xla-probe-", dir=os.environ.get(PROBE_RUNS)))
    data_root = resolve_data_root(cfg, job) if cfg.data.path else run_dir
    probe = Probe(warmup)
    job_train_step = job.train_step

    def probe_job_step(model, batch, ctx):
        """The sharding of the first batch tensor as the step receives it ('' = replicated)."""
        first = next(value for value in batch.values() if isinstance(value, torch.Tensor))
        probe.seen.setdefault("input_sharding", torch_xla._XLAC._get_xla_sharding_spec(first))
        return job_train_step(model, batch, ctx)

    job.train_step = probe_job_step  # on the instance, for this run
    reporter = FolderReporter(run_dir)
    command = goodput.Command()  # the record a driver keeps (the profile test reads its compilation)
    goodput.begin(RunFolder(run_dir), command)
    trainer = Trainer(cfg, job, runtime, run_dir, data_root, reporter, ray_datasets(cfg, job), [probe], command)
    try:
        trainer.fit()
    finally:
        del job.train_step
    goodput.end(RunFolder(run_dir), command, "completed")
    steps = probe.seen["steps"].values()
    return {
        **prepared(trainer),
        "run_dir": str(run_dir),
        "devices": runtime.local_devices,
        "compiles_after_warmup": sum(s["compiles"] for s in steps),
        "fallbacks_after_warmup": sorted({f for s in steps for f in s["fallbacks"]}),
        "steps_checked": len(steps),
        "losses": probe.seen["losses"],
        "input_sharding": probe.seen.get("input_sharding"),
        "seconds": round(time.perf_counter() - start, 1),  # the run's wall time, compiles included
    }


if __name__ == "__main__":
    main(sys.argv[1:])
