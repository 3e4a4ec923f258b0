"""Tokens/s of the raytpu loop vs a bare Transformers training loop on the causal-LM job.

Same model (``jobs/causal_lm/small.yaml``'s Llama, same seed), batch, AdamW and packed blocks,
one process on the CPU, fp32, measured side by side in one run (alternating, best of
``--repeats``). The bare loop is what a Transformers user writes by hand: ``model(input_ids,
labels=input_ids).loss``, ``backward``, ``step``. Both time only training steps (raytpu's
evaluations and checkpoints between steps are not steps). The last line is
``ratio=<raytpu/bare>``; the target is at least 0.95.

    python bench/causal_lm_throughput.py [--steps 20] [--batch 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loop_overhead import raytpu_loop, side_by_side  # noqa: E402
from raytpu.config import load_config  # noqa: E402
from raytpu.worker.optim import build_optimizer  # noqa: E402

CONFIG = "jobs/causal_lm/small.yaml"


def bare_transformers_loop(cfg, job, data_root: Path, warmup: int, steps: int) -> float:
    """Samples/s of the hand-written loop over the steps after ``warmup``."""
    torch.manual_seed(cfg.run.seed)
    model = job.build_model(cfg).train()
    loader = DataLoader(job.build_dataset(cfg, "train", data_root), cfg.data.global_batch_size, shuffle=True)
    optimizer = build_optimizer(cfg.optim, model)
    start = 0.0
    for done, batch in enumerate(loader):
        if done == warmup:
            start = time.perf_counter()
        if done == warmup + steps:
            break
        ids = batch["input_ids"]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.loop.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps * cfg.data.global_batch_size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / "causal_lm"
    atexit.register(shutil.rmtree, data_dir.parent, True)  # the benchmark keeps only what it prints
    overrides = [f"data.path={data_dir}", f"data.global_batch_size={args.batch}", "scaling.num_workers=1"]
    overrides += [f"loop.max_steps={args.warmup + args.steps}", f"loop.log_every={args.warmup + args.steps}"]
    overrides += ["logging.progress_bar=false", "logging.tensorboard=false", "job.sample_tokens=0"]
    cfg, job = load_config(CONFIG, overrides)
    job.synthesize(data_dir, **job.synth_options(cfg))
    tokens = cfg.job.seq_len
    print(f"model={CONFIG} batch={args.batch}x{tokens} steps={args.steps} threads={torch.get_num_threads()}")
    side_by_side(
        lambda: bare_transformers_loop(cfg, job, data_dir, args.warmup, args.steps) * tokens,
        lambda: raytpu_loop(cfg, job, data_dir, args.warmup, args.steps) * tokens,
        args.repeats,
        "tokens/s",
    )


if __name__ == "__main__":
    main()
