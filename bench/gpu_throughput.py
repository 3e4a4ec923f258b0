"""Tokens/s and MFU of a Llama-style causal LM: hand-written training loops, eager and
``torch.compile``'d, against raytpu's Trainer with its defaults and compiled, side by side in
one process.

On a GPU, the shape of issue 36: 789 M parameters (hidden 2048, 16 layers, 16 heads, 8 KV heads,
intermediate 5632, vocabulary 8192), sequences of 2048 tokens, batch 8, AdamW, bf16 autocast.
On the CPU a tiny shape in fp32, a few minutes. The hand-written loops are what a careful user
writes: a DataLoader with persistent workers and pinned memory, ``model(ids, labels=ids).loss``,
fused AdamW on a GPU, ``model.compile()`` for the compiled one. The last line is
``ratio=<raytpu's best / hand-written compiled>``; the target on a GPU is at least 0.97, with MFU
at least 50%. raytpu sharded (FSDP2 over the one device: the wrapper's cost alone) runs beside
its data-parallel default, ``sharded_ratio=`` (target: at least 0.95), and each raytpu loop's peak
memory (``torch.cuda.max_memory_allocated``) is printed beside ``raytpu.config.memory``'s estimate.

    python bench/gpu_throughput.py [--device auto|cpu|cuda] [--steps N] [--warmup N] [--repeats N]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.loop_overhead import raytpu_loop, synchronize  # noqa: E402
from raytpu.config import load_config, with_values  # noqa: E402
from raytpu.config.memory import estimate_run  # noqa: E402
from raytpu.runtime.base import gpu_peak_flops, local_gpu_has_bf16  # noqa: E402
from raytpu.runtime.kinds import compiles, resolve_precision  # noqa: E402

CONFIG = "jobs/causal_lm/small.yaml"


@dataclass(frozen=True)
class Shape:
    model: dict[str, int]  # Transformers' LlamaConfig fields
    seq_len: int
    vocabulary: int
    batch: int
    precision: str


SHAPES = {
    "cuda": Shape(
        {
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 5632,
            "max_position_embeddings": 2048,
        },
        seq_len=2048,
        vocabulary=8192,
        batch=8,
        precision="bf16",
    ),
    "cpu": Shape(
        {
            "hidden_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 384,
            "max_position_embeddings": 256,
        },
        seq_len=128,
        vocabulary=4096,
        batch=8,
        precision="fp32",
    ),
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def overrides(shape: Shape, data_dir: Path, total_steps: int) -> list[str]:
    values = [f"job.model_config.{key}={value}" for key, value in shape.model.items()]
    values += [f"job.seq_len={shape.seq_len}", f"job.vocab_size={shape.vocabulary}", "job.sample_tokens=0"]
    values += [f"data.path={data_dir}", f"data.global_batch_size={shape.batch}", "data.num_workers=2"]
    values += ["scaling.num_workers=1", f"loop.max_steps={total_steps}", f"loop.log_every={total_steps}"]
    values += ["loop.epochs=1000", "checkpoint.every_steps=0", "optim.weight_decay=0.1", "optim.scheduler=constant"]
    return values + ["logging.progress_bar=false", "logging.tensorboard=false"]


def hand_written(cfg, job, data_root: Path, warmup: int, steps: int, device: str, compiled: bool) -> float:
    """Samples/s of the hand-written loop over the steps after ``warmup``."""
    torch.manual_seed(cfg.run.seed)
    target = torch.device(device)
    model = job.build_model(cfg).to(target).train()
    if compiled:
        model.compile()
    loader = DataLoader(
        job.build_dataset(cfg, "train", data_root),
        cfg.data.global_batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=2,
        persistent_workers=True,
        pin_memory=target.type == "cuda",
    )
    optim = cfg.optim
    fused = True if target.type == "cuda" else None
    optimizer = torch.optim.AdamW(model.parameters(), optim.lr, tuple(optim.betas), optim.eps, fused=fused)
    dtype = DTYPES[SHAPES[device].precision]
    start = 0.0
    for done, batch in enumerate(loader):
        if done == warmup:
            synchronize(target)
            start = time.perf_counter()
        if done == warmup + steps:
            break
        ids = batch["input_ids"].to(target, non_blocking=True)
        with torch.autocast(target.type, dtype) if dtype is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.loop.clip_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(target)
    return steps * cfg.data.global_batch_size / (time.perf_counter() - start)


def raytpu_defaults(device: str) -> tuple[str, str]:
    """The precision and compile mode raytpu's ``auto`` picks on ``device``."""
    bf16 = device != "cuda" or local_gpu_has_bf16()
    precision, _ = resolve_precision(device, "auto", bf16)
    return precision, "default" if compiles(device, "auto") else ""


def measure(run: Callable[[], float]) -> tuple[float, float]:
    """One loop's samples/s and peak GPU memory (bytes; 0 on the CPU), its model and optimizer
    freed before the next one builds its own."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    rate = run()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rate, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / "causal_lm"
    shape = SHAPES[device]
    cfg, job = load_config(CONFIG, overrides(shape, data_dir, args.warmup + args.steps))
    job.synthesize(data_dir, **job.synth_options(cfg))
    precision, default_compile = raytpu_defaults(device)
    tokens = cfg.job.seq_len
    model = job.build_model(cfg)
    flops_per_sample = job.flops_per_sample(cfg, model)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    peak = gpu_peak_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device={name} torch={torch.__version__} parameters={parameters / 1e6:.1f}M")
    print(f"batch={cfg.data.global_batch_size}x{tokens} precision={shape.precision} steps={args.steps}")
    sharded_cfg = with_values(cfg, {"sharding.strategy": "full_shard"})
    default = f"raytpu, defaults ({precision}, {'compiled' if default_compile else 'eager'})"
    sharded = f"raytpu, sharded (FSDP2, {'compiled' if default_compile else 'eager'})"
    loops: dict[str, Callable[[], float]] = {
        "hand-written, eager": lambda: hand_written(cfg, job, data_dir, args.warmup, args.steps, device, False),
        "hand-written, torch.compile": lambda: hand_written(cfg, job, data_dir, args.warmup, args.steps, device, True),
        default: lambda: raytpu_loop(cfg, job, data_dir, args.warmup, args.steps, device, precision, default_compile),
        sharded: lambda: raytpu_loop(
            sharded_cfg, job, data_dir, args.warmup, args.steps, device, precision, default_compile
        ),
    }
    if not default_compile:
        loops["raytpu, loop.compile=true"] = lambda: raytpu_loop(
            cfg, job, data_dir, args.warmup, args.steps, device, precision, "default"
        )
    best, peaks = dict.fromkeys(loops, 0.0), dict.fromkeys(loops, 0)
    for repeat in range(args.repeats):
        for label, run in loops.items():
            try:
                rate, peaks[label] = measure(run)
            except Exception as exc:  # one loop that breaks (out of memory, a compile error) leaves the others' figures
                print(f"repeat {repeat}: {label}: failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            best[label] = max(best[label], rate)
            print(f"repeat {repeat}: {label}: {best[label] * tokens:,.0f} tokens/s (best so far)", flush=True)
    print("| loop | tokens/s | MFU |")
    print("|---|---|---|")
    for label, rate in best.items():
        mfu = f"{rate * flops_per_sample / peak:.1%}" if peak and flops_per_sample else "n/a (no peak for this device)"
        print(f"| {label} | {rate * tokens:,.0f} | {mfu} |")
    for label, run_cfg in ((default, cfg), (sharded, sharded_cfg)):
        estimated = estimate_run(run_cfg, job, precision).total
        measured = f"{peaks[label] / 1e9:.2f} GB measured" if peaks[label] else "no GPU to measure"
        print(f"memory {label}: {estimated / 1e9:.2f} GB estimated, {measured}")
    print(f"sharded_ratio={best[sharded] / max(best[default], 1e-9):.3f}")
    ours = max(rate for label, rate in best.items() if label.startswith("raytpu"))
    print(f"ratio={ours / max(best['hand-written, torch.compile'], 1e-9):.3f}")


if __name__ == "__main__":
    main()
