"""Tensor parallelism, Megatron-style: each decoder layer's attention and MLP split over the mesh's
``tensor`` axis, the first matrix product of each by its outputs (``colwise``: q, k, v, gate, up),
the second by its inputs (``rowwise``: o, down), so that a layer needs one all-reduce of its
activations in the forward and one in the backward.

Which layers split which way is the model's own plan: Transformers declares it for each
architecture (``config.base_model_tp_plan``, the plan ``from_pretrained(tp_plan="auto")`` uses), so
any architecture that declares one trains tensor-parallel without a plan written here. The runtimes
apply it each with its library: DTensor's ``parallelize_module`` on cpu and cuda (composed with
FSDP2, as torchtitan does), sharding annotations on xla (the weights' other dimension and the
embeddings and output head along the vocabulary too, as torchprime annotates them).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from raytpu.errors import ConfigError

#: the plan styles applied -> the dimension of an ``nn.Linear`` weight (out, in) the tensor axis splits
STYLES = {"colwise": 0, "rowwise": 1}


def tensor_plan(model: nn.Module) -> dict[str, str]:
    """Module name -> ``colwise`` / ``rowwise`` for each module the model's tensor-parallel plan
    names (Transformers' ``base_model_tp_plan``, whose patterns are relative to the base model and
    whose ``*`` stands for one part of a name: a layer's index). Under peft's LoRA the plan splits
    the layer each adapter wraps (``base_layer``) and the adapter's matrix on the same side:
    :func:`adapter_plan`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's PeftModel
    where = next(f"{name}." if name else "" for name, module in model.named_modules() if module is base)
    config = getattr(base, "config", None)
    declared = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(base, "base_model_prefix", "")
    if prefix and isinstance(getattr(base, prefix, None), nn.Module):
        declared = {f"{prefix}.{pattern}": style for pattern, style in declared.items()}
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"[^.]+") + "$"), style) for key, style in declared.items()]
    plan: dict[str, str] = {}
    for name, module in base.named_modules():
        for pattern, style in patterns:
            if pattern.match(name):
                plan.update(adapter_plan(f"{where}{name}", module, style))
    return plan


def adapter_plan(name: str, module: nn.Module, style: str) -> dict[str, str]:
    """The plan for one layer: the layer itself, or, where a LoRA adapter wraps it, its
    ``base_layer`` and the adapter's matrix that meets the split dimension: ``lora_B`` (out x r)
    split by its outputs beside a colwise layer, ``lora_A`` (r x in) by its inputs beside a rowwise
    one. The other, r wide, stays whole on every device of the group, which computes it alike, as
    the group's devices draw the same dropout."""
    if not hasattr(module, "base_layer"):
        return {name: style}
    side = "lora_B" if style == "colwise" else "lora_A"
    adapters = getattr(module, side)
    return {f"{name}.base_layer": style, **{f"{name}.{side}.{key}": style for key in adapters}}


def check_tensor_parallel(model: nn.Module, tensor: int) -> dict[str, str]:
    """The model's plan, checked for a tensor axis of ``tensor`` devices: declared, of the styles
    applied here, on linear layers, and splitting whole attention heads and whole dimensions. A
    ConfigError says what does not divide."""
    plan = tensor_plan(model)
    if not plan:
        raise ConfigError(
            f"sharding.mesh.tensor={tensor}: {type(model).__name__} declares no tensor-parallel plan (Transformers' "
            "base_model_tp_plan); train it with sharding.mesh.tensor=1 and shard it with sharding.mesh.fsdp"
        )
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise ConfigError(
            f"sharding.mesh.tensor={tensor}: {type(model).__name__}'s tensor-parallel plan uses {', '.join(unknown)}; "
            f"raytpu applies {' and '.join(STYLES)} only: use sharding.mesh.tensor=1"
        )
    modules = dict(model.named_modules())
    for name, style in plan.items():
        layer = modules[name]
        if not isinstance(layer, nn.Linear):
            raise ConfigError(f"sharding.mesh.tensor={tensor}: {name} is a {type(layer).__name__}, not a linear layer")
        width = layer.weight.shape[STYLES[style]]
        if width % tensor:
            side = "outputs" if style == "colwise" else "inputs"
            raise ConfigError(
                f"sharding.mesh.tensor={tensor} does not divide the {width} {side} of {name}: use a tensor axis "
                "that divides it"
            )
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if heads and heads % tensor:
            raise ConfigError(
                f"sharding.mesh.tensor={tensor} does not divide the model's {heads} attention heads ({field}): "
                "each device computes whole heads; use a tensor axis that divides it"
            )
    return plan


def parallelize(model: nn.Module, mesh: Any) -> int:
    """The plan applied with DTensor on ``mesh`` (the tensor axis's one-dimensional mesh): each
    weight becomes a DTensor sharded along its dimension, the activations a layer hands on stay plain
    tensors; a frozen weight (LoRA's base) stays frozen. Returns the layers split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = tensor_plan(model)
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    for name, param in model.named_parameters():  # the styles make new parameters, which train
        param.requires_grad_(name not in frozen)
    return len(plan)


def xla_partition_specs(model: nn.Module, fsdp_axis: str, tensor_axis: str | None) -> dict[str, tuple]:
    """Each parameter's partition spec over the SPMD mesh: the plan's layers split along the tensor
    axis on their dimension and along ``fsdp_axis`` on the other; the embeddings and the output head
    along the vocabulary (tensor) and the hidden size (fsdp); every other parameter along its first
    dimension over ``fsdp_axis`` (the layer norms' weights)."""
    specs: dict[str, tuple] = {}
    modules = dict(model.named_modules())
    for name, style in (tensor_plan(model) if tensor_axis else {}).items():
        layer = modules[name]
        split = STYLES[style]
        specs[f"{name}.weight"] = (tensor_axis, fsdp_axis) if split == 0 else (fsdp_axis, tensor_axis)
        if getattr(layer, "bias", None) is not None:
            specs[f"{name}.bias"] = (tensor_axis,) if split == 0 else (None,)
    vocabulary = vocabulary_weights(model) if tensor_axis else set()
    for name, param in model.named_parameters():
        if name in specs:
            continue
        if id(param) in vocabulary:
            specs[name] = (tensor_axis, fsdp_axis)
        else:
            specs[name] = (fsdp_axis,) + (None,) * (param.dim() - 1) if param.dim() else ()
    return specs


def vocabulary_weights(model: nn.Module) -> set[int]:
    """The ids of the embeddings' and the output head's weights (one weight where they are tied)."""
    if not hasattr(model, "get_input_embeddings"):
        return set()
    layers = (model.get_input_embeddings(), model.get_output_embeddings())
    return {id(layer.weight) for layer in layers if layer is not None}
