"""Peak memory and time of the causal LM's loss at the vocabularies people train with: the fused
loss (``jobs/causal_lm/fused_loss.py``, raytpu's default) against the model's own (the logits in
full, then ``cross_entropy``), the output layer's forward and backward and the loss alone, side by
side in one run.

For each vocabulary (32,000: Llama 2, Mistral; 128,256: Llama 3) it prints each loss's peak
memory above its inputs and its median time, then ``memory_ratio=`` (the model's own / fused: how
many times more memory the logits take) and ``time_ratio=`` (the model's own / fused: >= 1.0 means
the fused loss is not slower). On a GPU the peak is ``torch.cuda.max_memory_allocated``, in bf16;
on the CPU each loss runs in a process of its own and the peak is that process's resident set
(``ru_maxrss``), in fp32. Everything printed is also written to
``bench/results/fused_loss-<device>-<date>.txt``.

    python bench/fused_loss.py [--device auto|cpu|cuda] [--vocabularies 32000,128256]
                               [--tokens N] [--hidden N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jobs.causal_lm.fused_loss import linear_cross_entropy  # noqa: E402

LOSSES = ("fused", "own")


def own_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What a Transformers causal LM does: the logits in full, upcast, then the cross-entropy."""
    return F.cross_entropy((hidden @ weight.t()).float(), labels)


def inputs(tokens: int, hidden: int, vocabulary: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    states = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocabulary, hidden, device=device, dtype=dtype) / hidden**0.5).requires_grad_()
    return states, weight, torch.randint(0, vocabulary, (tokens,), device=device)


def step(loss: str, states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> Callable[[], None]:
    compute = linear_cross_entropy if loss == "fused" else own_loss

    def run() -> None:
        states.grad = weight.grad = None
        compute(states, weight, labels).backward()

    return run


def timed(run: Callable[[], None], repeats: int, device: str) -> float:
    """The median seconds of ``repeats`` runs after one warm-up."""
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def measure_here(loss: str, vocabulary: int, args: argparse.Namespace, device: str) -> dict[str, float]:
    """Peak bytes above the inputs and median seconds of one loss, in this process."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tensors = inputs(args.tokens, args.hidden, vocabulary, device, dtype)
    run = step(loss, *tensors)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        seconds = timed(run, args.repeats, device)
        return {"peak": torch.cuda.max_memory_allocated() - before, "seconds": seconds}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = timed(run, args.repeats, device)
    return {"peak": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, "seconds": seconds}


def measure(loss: str, vocabulary: int, args: argparse.Namespace, device: str) -> dict[str, float]:
    """On the CPU in a process of its own: its resident set's peak is this loss's alone."""
    if device == "cuda":
        return measure_here(loss, vocabulary, args, device)
    command = [sys.executable, __file__, "--child", loss, "--device", "cpu", "--vocabularies", str(vocabulary)]
    command += ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--vocabularies", default="32000,128256")
    parser.add_argument("--tokens", type=int, default=0, help="a step's (default: 16384 on a GPU, 4096 on the CPU)")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (default: 2048 on a GPU, 256 on the CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--child", choices=LOSSES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    args.tokens = args.tokens or (16384 if device == "cuda" else 4096)
    args.hidden = args.hidden or (2048 if device == "cuda" else 256)
    vocabularies = [int(v) for v in args.vocabularies.split(",")]
    if args.child:
        print(json.dumps(measure_here(args.child, vocabularies[0], args, device)))
        return
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    lines = [f"device={name} torch={torch.__version__} date={time.strftime('%Y-%m-%d %H:%M')}"]
    lines.append(f"tokens={args.tokens} hidden={args.hidden} repeats={args.repeats}")
    print("\n".join(lines), flush=True)
    for vocabulary in vocabularies:
        found = {loss: measure(loss, vocabulary, args, device) for loss in LOSSES}
        for loss, figures in found.items():
            lines.append(
                f"vocabulary={vocabulary} loss={loss}: peak {figures['peak'] / 2**20:,.0f} MiB, "
                f"{figures['seconds'] * 1e3:,.1f} ms"
            )
        fused, own = found["fused"], found["own"]
        lines.append(f"vocabulary={vocabulary} memory_ratio={own['peak'] / max(fused['peak'], 1):.2f}")
        lines.append(f"vocabulary={vocabulary} time_ratio={own['seconds'] / fused['seconds']:.3f}")
        print("\n".join(lines[-4:]), flush=True)
    kind = "cuda" if device == "cuda" else "cpu"
    path = Path(args.results) / f"fused_loss-{kind}-{time.strftime('%Y-%m-%d')}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
