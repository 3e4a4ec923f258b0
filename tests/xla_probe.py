"""Run the raytpu loop in-process on the XLA CPU device and report compiles after warm-up.

Used by tests in a subprocess (torch_xla reads PJRT_DEVICE / CPU_NUM_DEVICES once
per process). Usage: python -m tests.xla_probe WARMUP_STEPS OVERRIDE... ; prints one
JSON line: compiles and fallback counters seen after the warm-up steps, and the losses.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch_xla.debug.metrics as met

from raytpu.config import load_config
from raytpu.launcher import resolve_data_root
from raytpu.loop import LocalReporter, Trainer
from raytpu.runtime import make_runtime


def main(argv: list[str]) -> None:
    warmup, overrides = int(argv[0]), argv[1:]
    cfg, job = load_config(None, ["logging.progress_bar=false", *overrides])
    runtime = make_runtime("xla", cfg.scaling.precision, 1, 0, 0, cfg.xla)
    run_dir = Path(tempfile.mkdtemp(prefix="xla-probe-"))
    data_root = resolve_data_root(cfg, job) if cfg.data.path else run_dir
    trainer = Trainer(cfg, job, runtime, run_dir, data_root, LocalReporter(run_dir))
    seen: dict = {"losses": []}
    after_step = trainer._after_step
    log_closure = trainer._log_closure

    def probe_step() -> None:
        after_step()
        step = trainer.progress.step
        if step == warmup:
            met.clear_all()
        elif step > warmup:
            compile_data = met.metric_data("CompileTime")
            seen[step] = {
                "compiles": compile_data[0] if compile_data else 0,
                "fallbacks": sorted(n for n in met.counter_names() if n.startswith("aten::")),
            }

    def probe_log(stats, step, lr) -> None:
        seen["losses"].append(float(stats.cpu()[0]))
        log_closure(stats, step, lr)

    trainer._after_step = probe_step
    trainer.evaluate = lambda *args, **kwargs: {}  # eval graphs are not part of the training step
    trainer._log_closure = probe_log
    trainer.fit()
    steps = [k for k in seen if isinstance(k, int)]
    print(
        json.dumps(
            {
                "devices": runtime.local_devices,
                "compiles_after_warmup": max((seen[s]["compiles"] for s in steps), default=0),
                "fallbacks_after_warmup": sorted({f for s in steps for f in seen[s]["fallbacks"]}),
                "steps_checked": len(steps),
                "losses": seen["losses"],
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
