"""LoRA adapters through ``peft``, with TRL's ``ModelConfig`` settings (``--use_peft``, ``--lora_r``,
``--lora_alpha``, ``--lora_dropout``, ``--lora_target_modules``, ``--lora_modules_to_save``): the
base model frozen in the dtype it was loaded in (``job.dtype``), the adapters trained in fp32 (peft
casts bf16 and fp16 adapters to fp32). A checkpoint holds what trains (the adapters and the modules
saved whole, with their optimizer state); ``raytpu export`` writes a folder ``PeftModel`` loads, or,
with ``--merged``, the base with the adapters merged into it, which Transformers loads alone."""

from __future__ import annotations

from typing import Any

from torch import nn


def lora_config(job: Any) -> Any:  # -> peft.LoraConfig
    from peft import LoraConfig

    targets: Any = list(job.lora_target_modules) or None
    if targets == ["all-linear"]:
        targets = "all-linear"
    return LoraConfig(
        r=job.lora_r,
        lora_alpha=job.lora_alpha,
        lora_dropout=job.lora_dropout,
        target_modules=targets,
        modules_to_save=list(job.lora_modules_to_save) or None,
        task_type="CAUSAL_LM",
    )


def with_lora(model: nn.Module, job: Any) -> nn.Module:
    """``model`` with LoRA adapters (peft's ``PeftModel``); a target no module matches is one line
    that names the model's linear layers."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(job))
    except ValueError as exc:
        if "not found in the base model" not in str(exc) and "Target modules" not in str(exc):
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"job.lora_target_modules={list(job.lora_target_modules)} matches no module of the model; its linear "
            f"layers: {', '.join(linear)} (or all-linear)"
        ) from None


def check_lora(cfg: Any) -> None:
    """LoRA settings out of range, or that cannot be combined: one line that says which."""
    job = cfg.job
    if not job.use_peft:
        return
    if job.lora_r < 1 or job.lora_alpha <= 0 or not 0 <= job.lora_dropout < 1:
        raise ValueError(
            f"LoRA: job.lora_r={job.lora_r} (at least 1), job.lora_alpha={job.lora_alpha} (positive) and "
            f"job.lora_dropout={job.lora_dropout} (in [0, 1)) out of range"
        )
    if cfg.xla.scan_layers and job.lora_dropout > 0:
        raise ValueError(
            f"LoRA's dropout (job.lora_dropout={job.lora_dropout}) inside scanned layers (xla.scan_layers=true) "
            "crashes torch_xla 2.9's scan (random numbers in its loop): set --lora_dropout 0, or xla.scan_layers=false"
        )
