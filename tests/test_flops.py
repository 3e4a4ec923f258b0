"""Throughput accounting: FLOPs formulas against hand counts and torch's FLOP counter, MFU
arithmetic, documented peaks, and what a CPU run logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytpu.config import load_config
from raytpu.job import CountsTokens
from raytpu.jobs.cdeit import JOB as CDEIT
from raytpu.jobs.cdeit import model_config
from raytpu.jobs.cdeit.model import SMALL, DiT, DiTConfig, training_flops
from raytpu.runtime import make_runtime
from raytpu.runtime.base import Runtime, gpu_peak_flops
from raytpu.runtime.tpu import tpu_peak_flops
from raytpu.worker.flops import matmul_parameters, mfu, perf_scalars, transformer_flops_per_token
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.toy_job import ToyJob


class TinyDecoder(nn.Module):
    """A causal LM with nothing but matmuls: embedding, ``layers`` x (qkv, attention, proj, MLP), head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, tied: bool) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "qkv": nn.Linear(d, 3 * d, bias=False),
                    "proj": nn.Linear(d, d, bias=False),
                    "fc1": nn.Linear(d, 4 * d, bias=False),
                    "fc2": nn.Linear(4 * d, d, bias=False),
                }
            )
            for _ in range(layers)
        )
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, t, d = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["proj"](attended.transpose(1, 2).reshape(b, t, d))
            x = x + block["fc2"](F.gelu(block["fc1"](x)))
        return self.head(x)


# vocabulary 100, width 16, 2 layers, 8 tokens. Per layer 3d^2 + d^2 + 4d^2 + 4d^2 = 12 d^2 = 3,072
# matmul weights; the head (tied or not) 100 x 16 = 1,600: N = 2 x 3,072 + 1,600 = 7,744.
# Per token: 6N = 46,464 and 12 L d T = 12 x 2 x 16 x 8 = 3,072: 49,536 FLOPs.
VOCAB, D, LAYERS, HEADS, T = 100, 16, 2, 4, 8
HAND_N, HAND_PER_TOKEN = 7_744, 49_536


def count_training_flops(step: Callable[[], None]) -> int:
    """FLOPs that ``torch.utils.flop_counter.FlopCounterMode`` counts while ``step`` runs (a forward
    and a backward). Attention goes through the math kernel, whose matmuls it counts (it has no
    formula for the fused CPU kernel). A check for a job's declared FLOPs; slow for big models."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [True, False])
def test_transformer_formula_against_a_hand_count_and_the_flop_counter(tied):
    model = TinyDecoder(VOCAB, D, LAYERS, HEADS, tied)
    assert matmul_parameters(model) == HAND_N
    assert sum(p.numel() for p in model.parameters()) == HAND_N + (0 if tied else VOCAB * D)
    per_token = transformer_flops_per_token(matmul_parameters(model), LAYERS, D, T)
    assert per_token == HAND_PER_TOKEN
    tokens = torch.randint(0, VOCAB, (1, T))
    # exact: the counter sees every matmul of the forward and the backward, attention over the full
    # T x T matrix (the formula does not discount the causal mask either)
    assert count_training_flops(lambda: model(tokens).sum().backward()) == T * per_token


def test_mfu_arithmetic_against_a_hand_count():
    # a 1e9-parameter matmul count (L=24, d=2048) on 2,048-token samples: per token
    # 6e9 + 12 x 24 x 2,048 x 2,048 = 7,207,959,552 FLOPs; per sample x 2,048 = 14,761,901,162,496.
    per_sample = transformer_flops_per_token(10**9, 24, 2048, 2048) * 2048
    assert per_sample == 14_761_901_162_496
    # 64 samples a step at 0.5 s: 128 samples/s = 262,144 tokens/s, 1,889,523,348,799,488 FLOP/s;
    # on a v5e-16 (16 x 197e12 = 3,152e12 FLOP/s) that is an MFU of 0.59947...
    run_peak = 16 * tpu_peak_flops("v5litepod-16")
    values = perf_scalars(64, 0.5, per_sample, 2048, run_peak)
    assert values == {
        "perf/step_time_s": 0.5,
        "perf/samples_per_s": 128.0,
        "perf/tokens_per_s": 262_144.0,
        "perf/mfu": pytest.approx(1_889_523_348_799_488 / 3_152e12, rel=1e-12),
    }
    assert values["perf/mfu"] == pytest.approx(0.5994680681, rel=1e-9)
    assert mfu(per_sample, 128.0, run_peak) == values["perf/mfu"]


def test_without_flops_or_a_peak_there_is_no_mfu_and_without_tokens_no_tokens_per_s():
    assert set(perf_scalars(8, 0.25)) == {"perf/step_time_s", "perf/samples_per_s"}
    assert set(perf_scalars(8, 0.25, 1e9, None, None)) == {"perf/step_time_s", "perf/samples_per_s"}
    assert "perf/mfu" not in perf_scalars(8, 0.25, None, 4, 1e12)
    assert perf_scalars(8, 0.25, 1e9, None, 1e12)["perf/mfu"] == pytest.approx(8 / 0.25 * 1e9 / 1e12)


@pytest.mark.parametrize(
    "cfg",
    [SMALL, DiTConfig(image_size=64, hidden_size=32, num_heads=4, window_size=8, scales=2, stage_depth=1)],
    ids=["small", "wider-window"],
)
def test_cdeit_declared_flops_match_the_flop_counter(cfg):
    model = DiT(cfg)
    x, y = torch.randn(1, 1, cfg.image_size, cfg.image_size), torch.randn(1, 1, 16, 16)
    t = torch.tensor([500])
    assert count_training_flops(lambda: model(x, t, y)) * 3 == training_flops(cfg)  # the forward: exact
    counted = count_training_flops(lambda: model(x, t, y).sum().backward())
    # the real backward skips the input gradients of the patch and timestep embeddings: within 0.1%
    assert counted == pytest.approx(training_flops(cfg), rel=1e-3)
    assert counted <= training_flops(cfg)


def test_the_cdeit_job_declares_its_flops_and_no_tokens():
    cfg, job = load_config(None, ["job.name=cdeit", "job.image_size=32", "job.hidden_size=64"])
    assert job is CDEIT
    assert CDEIT.flops_per_sample(cfg, CDEIT.build_model(cfg)) == training_flops(model_config(cfg.job))
    assert training_flops(model_config(cfg.job)) == training_flops(SMALL) == 717_498_624
    assert not isinstance(CDEIT, CountsTokens)  # an image is no sequence: samples/s only


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", None),
        ("NVIDIA L40S", None),
        ("Tesla T4", None),
    ],
)
def test_gpu_peaks(name, peak):
    assert gpu_peak_flops(name) == peak


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("v4-16", 275e12),
        ("TPU v4", 275e12),
        ("v5litepod-8", 197e12),
        ("TPU v5 lite", 197e12),
        ("v5e", 197e12),
        ("v5p-8", 459e12),
        ("TPU v5", 459e12),
        ("v6e-8", 918e12),
        ("TPU v6 lite", 918e12),
        ("v3-8", None),
        ("cpu", None),
    ],
)
def test_tpu_peaks(name, peak):
    assert tpu_peak_flops(name) == peak


def test_a_runtime_peak_is_its_device_peak_times_its_devices():
    cpu = make_runtime("cpu", "auto", 1, 0, 0)
    assert (cpu.device_kind(), cpu.peak_flops()) == ("cpu", None)

    class FourChips(Runtime):
        local_devices = 4

        def device_peak_flops(self) -> float:
            return 197e12

    assert FourChips("bf16", 2, 0, 0).peak_flops() == 4 * 197e12


class CountedToy(ToyJob):
    """The toy job with declared FLOPs and tokens per sample (made-up numbers)."""

    def flops_per_sample(self, cfg, model):
        return 1e6

    def tokens_per_sample(self, cfg):
        return 4


def logged(run_dir: Path, peak: float | None) -> dict[str, list[float]]:
    cfg, _ = load_config(
        None, ["job.name=tests.toy_job", "data.global_batch_size=8", "loop.log_every=2", "loop.epochs=1"]
    )
    runtime = make_runtime("cpu", "auto", 1, 0, 0)
    if peak is not None:
        runtime.device_peak_flops = lambda: peak  # a device with a known peak
    Trainer(cfg, CountedToy(), runtime, run_dir, run_dir, FolderReporter(run_dir)).fit()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_cpu_run_logs_samples_and_tokens_per_s_but_no_mfu(tmp_path):
    scalars = logged(tmp_path, None)
    assert "perf/mfu" not in scalars
    samples, tokens = scalars["perf/samples_per_s"], scalars["perf/tokens_per_s"]
    assert len(samples) == 4  # 64 samples / 8 = 8 steps, logged every 2
    assert tokens == pytest.approx([4 * s for s in samples], rel=1e-6)


def test_a_known_peak_logs_mfu(tmp_path):
    scalars = logged(tmp_path, 1e9)
    expected = [1e6 * s / 1e9 for s in scalars["perf/samples_per_s"]]
    assert scalars["perf/mfu"] == pytest.approx(expected, rel=1e-6)
