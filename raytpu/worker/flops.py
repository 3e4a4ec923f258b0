"""Throughput accounting: model FLOPs per sample and model FLOPs utilisation (MFU), as pure functions.

MFU (PaLM, Chowdhery et al. 2022, appendix B) is the FLOPs the model needs per second at the
observed throughput, over the peak FLOP/s of the devices: ``flops_per_sample * samples_per_s /
(peak_per_device * devices)``. The numerator counts the model's matmuls for a forward and a
backward pass (3x the forward: the backward multiplies by the weights and by the activations) and
nothing an implementation adds: activation recomputation, FlashAttention's recompute, padding, and
the elementwise work (norms, activations, the optimizer) are all left out. A job declares its
FLOPs per sample (:meth:`raytpu.job.Job.flops_per_sample`); the runtime knows the peak
(:meth:`raytpu.runtime.base.Runtime.peak_flops`).
"""

from __future__ import annotations

import time
from typing import Any

from torch import nn


def transformer_flops_per_token(params: int, layers: int, d_model: int, seq_len: int) -> int:
    """Training FLOPs per token of a dense transformer, PaLM's ``6N + 12 L H Q T``.

    ``6 * params``: every weight does one multiply-add (2 FLOPs) per token in the forward and two
    in the backward. ``12 * layers * d_model * seq_len``: the attention scores ``Q K^T`` and their
    use ``A V`` (2 matmuls of ``d_model = heads * head_dim`` by ``seq_len`` per token and layer, 2
    FLOPs each, x3 for forward and backward). As in PaLM (and torchtitan), causal masking is not
    discounted: the full ``T x T`` matrix is counted.

    ``params`` is what :func:`matmul_parameters` counts: every parameter except lookup-table
    embeddings (a gather is no matmul); an output projection, tied to the token embedding or not,
    is a matmul and counts, once. That is torchtitan's reading of PaLM's ``N``; Kaplan et al.
    (2020) leave every embedding out, Chinchilla (Hoffmann et al. 2022, appendix F) counts the
    input embedding as a matmul too. With a large vocabulary the choice moves MFU by a few percent.
    """
    return 6 * params + 12 * layers * d_model * seq_len


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that multiply every token: all of ``model``'s but those that only an
    ``nn.Embedding`` holds (a weight tied to an output ``nn.Linear`` is counted, once). Biases and
    norm weights count too (a rounding error); a position table held as a bare ``nn.Parameter``
    would too, so such a model subtracts it."""
    used: dict[int, int] = {}
    for module in model.modules():
        if not isinstance(module, nn.Embedding):
            used.update({id(p): p.numel() for p in module.parameters(recurse=False)})
    return sum(used.values())


def mfu(flops_per_sample: float, samples_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's FLOP/s at ``samples_per_s`` over the run's peak FLOP/s
    (peak per device x devices of the whole run)."""
    return flops_per_sample * samples_per_s / peak_flops


def perf_scalars(
    global_batch: int,
    step_time: float,
    flops_per_sample: float | None = None,
    tokens_per_sample: int | None = None,
    peak_flops: float | None = None,
) -> dict[str, float]:
    """The ``perf/`` scalars of a log step: step time, samples/s, tokens/s (when the job counts
    tokens) and MFU (when the job declares its FLOPs and the run's devices have a known peak)."""
    samples_per_s = global_batch / step_time
    values = {"perf/step_time_s": step_time, "perf/samples_per_s": samples_per_s}
    if tokens_per_sample:
        values["perf/tokens_per_s"] = samples_per_s * tokens_per_sample
    if flops_per_sample and peak_flops:
        values["perf/mfu"] = mfu(flops_per_sample, samples_per_s, peak_flops)
    return values


class Throughput:
    """A run's ``perf/`` scalars at each log step, from the time since the last one: what the job
    declares (its FLOPs and tokens per sample) against the peak of the run's devices (every worker
    drives the same devices). ``note``: why there is no MFU on an accelerator without a known peak."""

    def __init__(self, job: Any, cfg: Any, model: nn.Module, runtime: Any) -> None:
        from raytpu.job import CountsFlops, CountsTokens

        self.global_batch = cfg.data.global_batch_size
        self.flops_per_sample = job.flops_per_sample(cfg, model) if isinstance(job, CountsFlops) else None
        self.tokens_per_sample = job.tokens_per_sample(cfg) if isinstance(job, CountsTokens) else None
        worker_peak = runtime.peak_flops()
        self.peak_flops = worker_peak * runtime.world_size if worker_peak else None
        missing = self.flops_per_sample and not self.peak_flops and runtime.on_accelerator()
        self.note = f"note: no documented bf16 peak for {runtime.device_kind()!r}, so no perf/mfu" if missing else ""
        self.since(0)

    def since(self, step: int) -> None:
        """Time the next log from now, at ``step`` (an epoch's start: its set-up is not a step's)."""
        self._last = (time.perf_counter(), step)

    def scalars(self, step: int) -> dict[str, float]:
        now = time.perf_counter()
        then, then_step = self._last
        self._last = (now, step)
        step_time = (now - then) / max(step - then_step, 1)
        return perf_scalars(
            self.global_batch, step_time, self.flops_per_sample, self.tokens_per_sample, self.peak_flops
        )
