"""Which attention kernel a causal LM runs: raytpu's ``causal`` (no mask built from the batch: a
causal block, within its sliding window and with its soft-capped scores where the architecture
has them), else the architecture's own or the one the job names."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: job.attn_implementation -> Transformers' name
ATTENTION = {"causal": "raytpu_causal", "sdpa": "sdpa", "eager": "eager"}


def check_attention(name: str) -> None:
    """``name`` is raytpu's ``causal`` or one of Transformers' own kernels, else a one-line error
    listing them. Transformers' list is read from ``transformers.modeling_utils`` (3 to 4 s of
    imports in the driver): only for a name that is not raytpu's."""
    if name in ATTENTION:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = [*ATTENTION, *(other for other in ALL_ATTENTION_FUNCTIONS if other not in ATTENTION and "|" not in other)]
    if name not in known:
        raise ValueError(f"job.attn_implementation={name!r} is not one of {', '.join(known)}")


def attention_implementation(name: str) -> str:
    """Transformers' attention for ``job.attn_implementation``. ``causal`` is raytpu's, registered
    under a name of its own with no mask function: no mask is built from the batch, and each layer
    attends causally (SDPA's ``is_causal``), within its sliding window and with its soft-capped
    scores where the architecture says so (:func:`causal_attention`), in one fixed shape.
    Transformers' own ``sdpa`` first checks ``position_ids`` for packed sequences with a
    data-dependent branch: a host sync in every step on XLA."""
    from transformers import AttentionInterface

    if name == "causal":
        AttentionInterface.register(ATTENTION[name], causal_attention)
    return ATTENTION.get(name, name)


def attention_for(job: Any, config: Any) -> str | None:
    """Transformers' attention for the job's model: ``causal`` where the architecture attends as
    it computes (else None: the architecture's own choice, as a model with attention sinks needs)."""
    if job.attn_implementation == "causal" and not causal_fits(config):
        return None
    return attention_implementation(job.attn_implementation)


def causal_fits(config: Any) -> bool:
    """Whether :func:`causal_attention` computes the architecture's attention: one with an SDPA
    path (causal, maybe within a sliding window), or whose only other need is soft-capped scores
    (Gemma 2)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        return False
    return bool(getattr(model_class, "_supports_sdpa", False) or getattr(config, "attn_logit_softcapping", None))


def causal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A decoder layer's causal attention over a whole block, with its operands in one dtype (under
    autocast the rotary embedding leaves the query and key in float32 while the value is in the
    autocast dtype, and autocasts that do not list SDPA, XLA's, pass the mix on). Plain causal
    attention is Transformers' SDPA with ``is_causal``; a sliding window shorter than the block or
    soft-capped scores (Gemma 2) are computed as Transformers' eager attention computes them, the
    mask made from the shapes alone; a four-dimensional mask given (a row's documents kept apart:
    ``sft.document_mask``) is applied too."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    query, key = query.to(value.dtype), key.to(value.dtype)
    window = sliding_window if sliding_window and sliding_window < key.shape[2] else None
    given = attention_mask if attention_mask is not None and attention_mask.dim() == 4 else None
    if window is None and softcap is None:  # a row's documents apart (sft.document_mask), else the whole block
        return sdpa_attention_forward(module, query, key, value, given, dropout=dropout, scaling=scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    rows = torch.arange(query.shape[2], device=query.device)[:, None] + (key.shape[2] - query.shape[2])
    columns = torch.arange(key.shape[2], device=query.device)[None, :]
    keep = columns <= rows
    if window is not None:
        keep = keep & (columns > rows - window)
    if given is not None:
        keep = keep & given if given.dtype == torch.bool else keep & (given == 0)
    scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None
