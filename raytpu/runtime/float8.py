"""float8 training (``scaling.precision: fp8``): a model's linear layers computed in float8 by
torchao, as torchtitan trains Llama on H100s.

Every ``nn.Linear`` whose two dimensions are multiples of 16 (what float8 matmuls take) becomes
torchao's ``Float8Linear``, except the output head (a Transformers model's output embeddings,
else the model's last linear layer), which decides the loss and gains little. The rest of the
model computes in bf16 under autocast, and the float8 layers keep their weights in fp32 under the
same parameter names: a checkpoint of an fp8 run loads into a bf16 or fp32 model, and back.

Two scalings (``scaling.fp8_recipe``): ``tensorwise``, one scale per tensor, the faster, which under
FSDP2 on GPUs also gathers the weights in float8 (half the bytes of bf16); ``rowwise``, one scale
per row, the more accurate. Either needs float8 tensor cores: compute capability 8.9 and above
(L4, L40S, H100, H200, B200); the plan refuses other devices.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

#: the first CUDA compute capability with float8 tensor cores (Ada, Hopper)
FLOAT8_CAPABILITY = (8, 9)

#: GPUs with float8 tensor cores, by the names Ray gives them (``accelerator_type:<name>``)
GPUS_WITH_FLOAT8 = frozenset({"L4", "L40", "L40S", "H100", "H200", "H20", "GH200", "B100", "B200", "GB200"})

#: scaling.fp8_recipe's values (torchao's recipe names)
RECIPES = ("tensorwise", "rowwise")

#: what a matmul in float8 needs of a layer's dimensions
MULTIPLE = 16


def has_float8(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has float8 tensor cores."""
    return tuple(capability) >= FLOAT8_CAPABILITY


def check_float8(device: torch.device) -> None:
    """A RuntimeError that says why this worker's GPU cannot run fp8, where it cannot."""
    capability = torch.cuda.get_device_capability(device)
    if not has_float8(capability):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"scaling.precision=fp8 needs float8 tensor cores (compute capability 8.9+) and this worker's "
            f"{name} is {capability[0]}.{capability[1]}: use scaling.precision=bf16"
        )


def output_head(model: nn.Module) -> nn.Module | None:
    """The layer that makes the model's outputs: a Transformers model's output embeddings, else its
    last ``nn.Linear`` (None: it has none)."""
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    if head is not None:
        return head
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return linears[-1] if linears else None


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the linear layers fp8 computes in float8 (see the module docstring)."""
    head = output_head(model)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not head
        and module.in_features % MULTIPLE == 0
        and module.out_features % MULTIPLE == 0
    ]


def convert_to_float8(model: nn.Module, recipe: str, gather_in_float8: bool = False) -> list[str]:
    """Swap the :func:`float8_layers` of ``model`` for torchao's ``Float8Linear`` in place (before
    compiling and sharding it); ``gather_in_float8``: FSDP2 all-gathers their weights in float8
    (``tensorwise`` only). Returns the layers converted."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise RuntimeError(
            f"scaling.precision=fp8 computes linear layers in float8 with torchao, which does not load here ({exc}): "
            "pip install 'raytpu[fp8]'"
        ) from None
    chosen = set(float8_layers(model))
    config = Float8LinearConfig.from_recipe_name(recipe)
    if gather_in_float8 and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    return sorted(chosen)


def refresh_float8_scales(model: nn.Module) -> None:
    """After an optimizer step of a model whose float8 weights FSDP2 gathers: their scales for the
    next step, computed for all layers at once (torchao's one all-reduce instead of one a layer)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
