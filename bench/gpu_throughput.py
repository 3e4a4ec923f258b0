"""Tokens/s and MFU of a Llama-style causal LM: hand-written training loops, eager and
``torch.compile``'d, against raytpu's Trainer (its defaults, the model's own loss instead of the
fused one, fp8, FSDP2), side by side in one process, each loop the median of ``--repeats`` rounds.

On a GPU, the 789 M shape (hidden 2048, 16 layers, 16 heads, 8 KV heads, intermediate 5632,
vocabulary 8192), sequences of 2048 tokens, batch 8, AdamW, bf16 autocast; ``--shape 3b`` a 2.9 B
shape that fits one 80 GB GPU at batch 4 (Llama 3.2 3B's layers: hidden 3072, 28 layers, 24 heads,
8 KV heads, intermediate 8192), where float8 gains more. On the CPU a tiny shape in fp32, a few
minutes. The hand-written loops are what a careful user writes: a DataLoader with persistent
workers and pinned memory, ``model(ids, labels=ids).loss``, fused AdamW on a GPU,
``model.compile()`` for the compiled one.

The ratios at the end (targets on an H100 or H200): ``ratio=`` raytpu's defaults / hand-written
compiled (>= 0.98); ``fp8_ratio=`` raytpu fp8 / raytpu defaults (>= 1.15; GPUs with float8 only);
``fused_loss_ratio=`` raytpu defaults / raytpu with the model's own loss (>= 1.0);
``sharded_ratio=`` FSDP2 over the one device / data-parallel (>= 0.95). MFU is printed counting the
full attention matrix (PaLM's count, torchtitan's) and its causal half. Each raytpu loop's peak
memory (``torch.cuda.max_memory_allocated``) is printed beside ``raytpu.config.memory``'s estimate;
``--batch N`` runs another batch (the fused loss's larger batch in the same memory), ``--vocabulary N``
another vocabulary (32000: Llama 2's; 128256: Llama 3's, where the fused loss pays). Everything
printed is also written to ``bench/results/gpu_throughput-<device>-<shape>-<date>.txt``, headed
by the device, its driver, torch and the date.

    python bench/gpu_throughput.py [--device auto|cpu|cuda] [--shape 789m|3b|tiny] [--batch N]
                                   [--vocabulary N] [--steps N] [--warmup N] [--repeats N]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import shutil
import statistics
import subprocess
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
from raytpu.runtime.base import gpu_peak_flops, has_float8, local_gpu_has_bf16  # noqa: E402
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
    "789m": Shape(
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
    "3b": Shape(
        {
            "hidden_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "intermediate_size": 8192,
            "max_position_embeddings": 2048,
        },
        seq_len=2048,
        vocabulary=8192,
        batch=4,
        precision="bf16",
    ),
    "tiny": Shape(
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


def hand_written(
    cfg, job, data_root: Path, warmup: int, steps: int, device: str, compiled: bool, precision: str
) -> float:
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
    dtype = DTYPES[precision]
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


class Output:
    """Prints, and keeps what it printed for the results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self, folder: Path, device: str, shape: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        kind = "-".join(device.lower().replace(",", "").split()[:3])
        path = folder / f"gpu_throughput-{kind}-{shape}-{time.strftime('%Y-%m-%d')}.txt"
        path.write_text("\n".join(self.lines) + "\n")
        return path


def driver_version() -> str:
    """The NVIDIA driver's version (``nvidia-smi``), or "none"."""
    try:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return "none"
    return found.stdout.strip().splitlines()[0] if found.returncode == 0 and found.stdout.strip() else "none"


def mfu_columns(rate: float, cfg, job, model_flops: float, peak: float | None) -> str:
    """MFU with the full attention matrix counted, and with its causal half."""
    if not peak:
        return "n/a | n/a"
    config, seq = job_architecture(cfg), cfg.job.seq_len
    half_attention = 6 * config.num_hidden_layers * config.hidden_size * seq * seq  # per sample
    return f"{rate * model_flops / peak:.1%} | {rate * (model_flops - half_attention) / peak:.1%}"


def job_architecture(cfg):
    from raytpu.jobs.causal_lm import architecture

    return architecture(cfg.job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--shape", choices=sorted(SHAPES), help="default: 789m on a GPU, tiny on the CPU")
    parser.add_argument("--batch", type=int, default=0, help="samples a step (default: the shape's)")
    parser.add_argument("--vocabulary", type=int, default=0, help="e.g. 32000 or 128256 (default: the shape's)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    shape_name = args.shape or ("789m" if device == "cuda" else "tiny")
    shape = SHAPES[shape_name]
    if args.batch:
        shape = dataclasses.replace(shape, batch=args.batch)
    if args.vocabulary:
        shape = dataclasses.replace(shape, vocabulary=args.vocabulary)
    data_dir = Path(tempfile.mkdtemp(prefix="bench-data-")) / "causal_lm"
    atexit.register(shutil.rmtree, data_dir.parent, True)
    cfg, job = load_config(CONFIG, [*overrides(shape, data_dir, args.warmup + args.steps), f"scaling.runtime={device}"])
    job.synthesize(data_dir, **job.synth_options(cfg))
    precision, default_compile = raytpu_defaults(device)
    tokens = cfg.job.seq_len
    with torch.device("meta"):
        model = job.build_model(cfg)
    flops_per_sample = job.flops_per_sample(cfg, model)
    parameters = sum(p.numel() for p in model.parameters())
    del model
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    peak = gpu_peak_flops(name) if device == "cuda" else None
    out = Output()
    out(f"device={name} driver={driver_version()} torch={torch.__version__} date={time.strftime('%Y-%m-%d %H:%M')}")
    out(f"shape={shape_name} parameters={parameters / 1e6:.1f}M batch={shape.batch}x{tokens}")
    out(f"vocabulary={shape.vocabulary}")
    out(f"precision={shape.precision} steps={args.steps} warmup={args.warmup} repeats={args.repeats}")
    compiled = "compiled" if default_compile else "eager"
    own_loss = with_values(cfg, {"job.fused_loss": False})  # what a hand-written loop takes: the model's loss
    default = f"raytpu, defaults ({precision}, {compiled}, fused loss)"
    variants = {
        default: cfg,
        f"raytpu, the model's own loss ({precision}, {compiled})": own_loss,
        f"raytpu, sharded (FSDP2, {compiled})": with_values(cfg, {"sharding.strategy": "full_shard"}),
    }
    float8 = device == "cuda" and has_float8(torch.cuda.get_device_capability())
    fp8 = f"raytpu, fp8 (tensorwise, {compiled})"

    def hand(compiled: bool) -> Callable[[], float]:
        return lambda: hand_written(own_loss, job, data_dir, args.warmup, args.steps, device, compiled, shape.precision)

    def ours(run_cfg, run_precision: str, mode: str) -> Callable[[], float]:
        return lambda: raytpu_loop(run_cfg, job, data_dir, args.warmup, args.steps, device, run_precision, mode)

    loops: dict[str, Callable[[], float]] = {
        "hand-written, eager": hand(False),
        "hand-written, torch.compile": hand(True),
        **{label: ours(run_cfg, precision, default_compile) for label, run_cfg in variants.items()},
    }
    if float8:
        loops[fp8] = ours(cfg, "fp8", default_compile)
    if not default_compile:
        loops["raytpu, loop.compile=true"] = ours(cfg, precision, "default")
    rates: dict[str, list[float]] = {label: [] for label in loops}
    peaks = dict.fromkeys(loops, 0)
    for repeat in range(args.repeats):
        for label, run in loops.items():
            try:
                rate, peaks[label] = measure(run)
            except Exception as exc:  # one loop that breaks (out of memory, a compile error) leaves the others' figures
                out(f"repeat {repeat}: {label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            rates[label].append(rate)
            out(f"repeat {repeat}: {label}: {rate * tokens:,.0f} tokens/s")
    median = {label: statistics.median(found) if found else 0.0 for label, found in rates.items()}
    out("| loop | tokens/s (median) | min - max | MFU, full attention | MFU, causal half |")
    out("|---|---|---|---|---|")
    for label, rate in median.items():
        spread = f"{min(rates[label]) * tokens:,.0f} - {max(rates[label]) * tokens:,.0f}" if rates[label] else "failed"
        out(f"| {label} | {rate * tokens:,.0f} | {spread} | {mfu_columns(rate, cfg, job, flops_per_sample, peak)} |")
    estimated_precisions = {**dict.fromkeys(variants, precision), fp8: "fp8"}
    for label, run_cfg in [*variants.items(), *([(fp8, cfg)] if float8 else [])]:
        estimated = estimate_run(run_cfg, job, estimated_precisions[label]).total
        measured = f"{peaks[label] / 1e9:.2f} GB measured" if peaks[label] else "no GPU to measure"
        out(f"memory {label}: {estimated / 1e9:.2f} GB estimated, {measured}")

    def ratio(name: str, top: str, bottom: str) -> None:
        out(f"{name}={median[top] / median[bottom]:.3f}" if median[top] and median[bottom] else f"{name}=n/a")

    labels = list(variants)
    ratio("sharded_ratio", labels[2], default)
    ratio("fused_loss_ratio", default, labels[1])
    if float8:
        ratio("fp8_ratio", fp8, default)
    ratio("ratio", default, "hand-written, torch.compile")
    named = f"{shape_name}-vocabulary-{shape.vocabulary}" if args.vocabulary else shape_name
    print(f"results: {out.save(Path(args.results), name, named)}")


if __name__ == "__main__":
    main()
