"""A model's decoder layers run as one scanned block on XLA (``xla.scan_layers``): torch_xla's
``scan`` compiles one layer's forward and backward and loops over the layers' weights, where an
unrolled model puts each of its N layers into the step's graph, so that the compile time stops
growing with the depth.

The weights are kept stacked, one tensor of N layers for each weight of a layer (as MaxText and
JAX models keep scanned weights): the step's graph then holds a few stacked weights, their
gradients and their optimizer updates, not N of each, and its compile time is flat in N (with the
layers' own weights stacked at every step, as ``scan_layers`` does, the N slices of the gradients
and the N optimizer updates kept it growing). The stack lives where the layers are, in the
``nn.ModuleList`` that holds them: a loop over a slice of it (``for layer in self.layers[:n]``, as
Transformers' decoders run their layers) gets one callable that scans all of them. A state dict of
the model still names every layer's weights as the unrolled model does (``model.layers.3.mlp...``),
so checkpoints, exports and ``raytpu test`` never see the stack.

Every tensor a layer receives besides its hidden states (the rotary position embeddings, a
fine-tuning batch's document mask, positions) travels with them through the scan, as floating
point (the carry is differentiable): a mask of B x T x T costs 4 bytes an entry there, and its
gradient as much. Every other argument (flags) is the same for each layer.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from raytpu.errors import ConfigError

#: how a stacked weight is named on the layer list: ``stacked__self_attn__q_proj__weight``
STACKED = "stacked__"


def require_jax_bridge() -> None:
    """torch_xla's scan under SPMD calls JAX through torchax in its backward; where torchax cannot
    be imported (it imports flax, which it does not declare), the error is raised inside autograd's
    backward and the process dies of a segmentation fault. Refused in one line before the first step."""
    from torch_xla._internal.jax_workarounds import maybe_get_jax, maybe_get_torchax

    if maybe_get_jax(log=False) is None or maybe_get_torchax() is None:
        raise ConfigError(
            "xla.scan_layers under SPMD: torch_xla's scan calls JAX through torchax, which cannot be imported "
            "here (it needs jax and flax): install raytpu's xla (or tpu) extra, or set xla.scan_layers=false"
        )


def layer_stack(model: nn.Module, units: list[nn.Module]) -> nn.ModuleList:
    """The ``nn.ModuleList`` whose children are exactly the model's repeated blocks ``units``; a
    ConfigError when the model holds them otherwise or when they are not alike (scan runs one
    layer's computation with each layer's weights)."""
    wanted = {id(unit) for unit in units}
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) and {id(child) for child in module} == wanted:
            check_alike(model, list(module))
            return module
    raise ConfigError(
        "xla.scan_layers: the model's repeated blocks (sharding.layers) are not the children of one nn.ModuleList; "
        "scan runs a stack of identical layers: set xla.scan_layers=false"
    )


def check_alike(model: nn.Module, layers: list[nn.Module]) -> None:
    """The layers' classes, parameter names and shapes, and the attention each uses, are the same."""

    def signature(layer: nn.Module) -> tuple:
        return type(layer), tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())

    different = [index for index, layer in enumerate(layers) if signature(layer) != signature(layers[0])]
    kinds = set(getattr(getattr(model, "config", None), "layer_types", None) or [])
    if different or len(kinds) > 1:
        mixed = ", ".join(sorted(kinds))
        what = f"layer {different[0]} differs from layer 0" if different else f"its layers mix {mixed}"
        raise ConfigError(
            f"xla.scan_layers: {type(model).__name__}'s blocks are not alike ({what}); scan runs one layer's "
            "computation for all of them: set xla.scan_layers=false"
        )


class ScannedLayers(nn.ModuleList):
    """A layer list holding its layers' weights stacked (:func:`scan_in_place` makes one); its
    slices run as one scan."""

    template: nn.Module  # layer 0's structure: each step of the scan is a functional call of it
    names: list[str]  # the weights of one layer, in its own names (``self_attn.q_proj.weight``)
    partition: Callable[..., Any]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            if index.indices(len(self)) != (0, len(self), 1):
                raise ValueError("a scanned layer list runs all of its layers: slice it whole")
            return [LayerScan(self)]
        return super().__getitem__(index)

    def stacked(self) -> dict[str, torch.Tensor]:
        return {name: self._parameters[STACKED + name.replace(".", "__")] for name in self.names}


def scan_in_place(stack: nn.ModuleList, recompute: bool) -> dict[str, str]:
    """Stack ``stack``'s layer weights in place and make its slices run as one scan; ``recompute``:
    activation checkpointing, the backward recomputing what AOTAutograd's min-cut partition does not
    keep. Returns each stacked weight's name (relative to the list) with its layer-0 name."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    layers = list(stack)
    names = [name for name, _ in layers[0].named_parameters()]
    template = copy.deepcopy(layers[0])
    weights = [dict(layer.named_parameters()) for layer in layers]
    for name in names:
        trains = weights[0][name].requires_grad  # a LoRA run's frozen base stays frozen
        stacked = nn.Parameter(torch.stack([weight[name].detach() for weight in weights]), requires_grad=trains)
        stacked.no_weight_decay = not decays(layers[0], name)  # raytpu.worker.optim's groups keep the rule
        stack.register_parameter(STACKED + name.replace(".", "__"), stacked)
    for layer in layers:
        for module in layer.modules():
            module._parameters.clear()
        layer.forward = functools.partial(runs_one_by_one, type(layer).__name__)  # only a scan runs them now
    stack.__class__ = ScannedLayers
    object.__setattr__(stack, "template", template)  # not a child: its weights are the stack's
    stack.names = names
    stack.partition = min_cut_rematerialization_partition if recompute else default_partition
    stack.register_state_dict_post_hook(unstack_state)
    stack.register_load_state_dict_pre_hook(stack_state)
    return {STACKED + name.replace(".", "__"): f"0.{name}" for name in names}


def runs_one_by_one(layer_class: str, *args: Any, **kwargs: Any) -> Any:
    """A scanned layer called by itself: the model loops over its layers one by one (GPT-2's ``for
    block in self.h``) instead of over a slice of the list, which is what a scan replaces."""
    raise ConfigError(
        f"xla.scan_layers: this model calls its {layer_class} layers one by one, not as a slice of their list, "
        "so a scan cannot run them: set xla.scan_layers=false"
    )


def decays(layer: nn.Module, name: str) -> bool:
    """Whether a layer's weight takes weight decay, as the optimizer's groups decide for it in place:
    no bias, no normalisation weight."""
    owner = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
    normalisation = isinstance(owner, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or type(owner).__name__.endswith("Norm")
    return not (normalisation or "bias" in name)


def unstacked_training(model: nn.Module) -> dict[str, bool]:
    """Whether each layer weight of the model's scanned layer lists trains, under the name a state
    dict gives it (``model.layers.3.mlp.up_proj.weight``): a state dict holds copies of the stack's
    slices, which say nothing of it."""
    from raytpu.runtime.torch_fsdp import WRAPPED

    found: dict[str, bool] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ScannedLayers):
            where = f"{prefix}.".replace(WRAPPED, "") if prefix else ""  # FSDPv2's wrapper, hidden
            for name, stacked in module.stacked().items():
                found.update({f"{where}{index}.{name}": stacked.requires_grad for index in range(len(module))})
    return found


def unstack_state(module: ScannedLayers, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A state dict names each layer's weights as the unrolled model does."""
    for name, stacked in module.stacked().items():
        state.pop(prefix + STACKED + name.replace(".", "__"), None)
        for index in range(stacked.shape[0]):
            state[f"{prefix}{index}.{name}"] = stacked[index].clone()


def stack_state(module: ScannedLayers, state: dict[str, Any], prefix: str, *args: Any) -> None:
    """Layer weights under their unrolled names are loaded into the stack."""
    for name in module.names:
        keys = [f"{prefix}{index}.{name}" for index in range(len(module))]
        if all(key in state for key in keys):
            state[prefix + STACKED + name.replace(".", "__")] = torch.stack([state.pop(key) for key in keys])


class LayerScan:
    """All of a list's layers, called as one of them is: ``(hidden_states, *args, **kwargs)``."""

    def __init__(self, stack: ScannedLayers) -> None:
        self.stack = stack

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from torch_xla.experimental.scan import scan

        leaves, spec = tree_flatten((args, kwargs))
        carried = [index for index, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
        template = self.stack.template

        def one_layer(carry: tuple[torch.Tensor, ...], weights: dict[str, torch.Tensor]) -> tuple[Any, None]:
            hidden, *tensors = carry
            now = list(leaves)
            for index, tensor in zip(carried, tensors, strict=True):
                now[index] = tensor.to(leaves[index].dtype)  # a mask or positions, as the layers take them
            call_args, call_kwargs = tree_unflatten(now, spec)
            out = torch.func.functional_call(template, weights, (hidden, *call_args), call_kwargs, strict=True)
            return (out[0] if isinstance(out, tuple) else out, *tensors), None

        # the carry is differentiable: a mask (bool) or positions (integers) travel as floats
        init = (hidden, *(as_carried(leaves[index]) for index in carried))
        final, _ = scan(one_layer, init, self.stack.stacked(), partition_fn=self.stack.partition)
        return final[0]


def as_carried(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor the layers take, as the scan carries it: floating point (a fine-tuning batch's
    document mask is bool: one captured from outside the scanned function fails its tracing)."""
    return tensor if tensor.is_floating_point() else tensor.float()
