"""What a sharded model shards unit by unit, and how FSDPv2's checkpoints stay plain: pure torch,
tested without torch_xla.

FSDPv2 (torch_xla's ``SpmdFullyShardedDataParallel``) on xla and FSDP2 (``fully_shard``) on cpu
and cuda shard each unit's parameters on their own; sharding the model's repeated blocks (a
Transformers model's decoder layers) instead of only the whole model lets one block's weights be
gathered at a time. The unit is named by class (``sharding.layers``), as Transformers'
``fsdp_config["transformer_layer_cls_to_wrap"]`` does, and defaults to the classes a Transformers
model declares in ``_no_split_modules`` (the same default as Transformers' Trainer and Accelerate).

A wrapper keeps its module as ``_orig_module``, which would put ``_orig_module.`` into every
parameter name under it. :func:`plain_state_dict_names` hides it, so that a checkpoint of a
sharded run has the plain model's names: it loads into an unwrapped model (export, ``raytpu
test`` on one device) and back into a wrapped one.
"""

from __future__ import annotations

from typing import Any

from torch import nn

WRAPPED = "_orig_module."

NO_UNITS = (
    "sharding.activation_checkpointing checkpoints the model's repeated blocks, and this model declares "
    "none: set sharding.layers to their class names"
)


def wrapping_units(model: nn.Module, class_names: list[str]) -> set[type[nn.Module]]:
    """The module classes wrapped one by one: ``class_names`` (``sharding.layers``), else the
    model's ``_no_split_modules``; empty when neither names any (the whole model is one unit)."""
    names = list(class_names) or list(getattr(model, "_no_split_modules", None) or [])
    classes = {type(module).__name__: type(module) for module in model.modules()}
    missing = [name for name in names if name not in classes]
    if missing:
        known = ", ".join(sorted(name for name in classes if name != type(model).__name__)[:12])
        raise ValueError(
            f"sharding.layers: the model has no module of class {', '.join(missing)}; its module classes "
            f"include {known}"
        )
    return {classes[name] for name in names}


def units_of(model: nn.Module, units: set[type[nn.Module]]) -> list[nn.Module]:
    """The model's modules of the unit classes, outermost only (a unit inside a unit is not one)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, tuple(units)) and module is not model:
            found.append(module)
            inside.update(id(child) for child in module.modules())
    return found


def plain_state_dict_names(wrapper: nn.Module) -> None:
    """Save ``wrapper``'s entries without its ``_orig_module.`` and load plain names into it."""
    wrapper.register_state_dict_post_hook(_drop_wrapper_name)
    wrapper.register_load_state_dict_pre_hook(_add_wrapper_name)


def _drop_wrapper_name(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    _rename(state_dict, prefix + WRAPPED, prefix)


def _add_wrapper_name(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:  # (local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
    plain = [key for key in state_dict if key.startswith(prefix) and not key.startswith(prefix + WRAPPED)]
    if plain:
        _rename(state_dict, prefix, prefix + WRAPPED, only=set(plain))


def _rename(state_dict: dict[str, Any], old: str, new: str, only: set[str] | None = None) -> None:
    """Replace the leading ``old`` of keys by ``new``, in place, keeping the entries' order."""
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        if key.startswith(old) and (only is None or key in only):
            key = new + key[len(old) :]
        state_dict[key] = value
