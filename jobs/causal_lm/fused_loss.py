"""The causal LM's loss without its logits: the output layer and the cross-entropy fused, a chunk
of tokens at a time (``job.fused_loss``, on by default).

A language model's logits are the largest tensor of its step: tokens x vocabulary, kept in fp32
for the loss, with their gradient beside them (a 32k vocabulary over 8k tokens: 1 GB each). As
Liger's fused linear cross-entropy does, :class:`LinearCrossEntropy` computes them a chunk of tokens
at a time, and with them the loss's gradients with respect to the hidden states and the output
layer's weight, right away (the loss is the step's last operation: its gradient is known in the
forward); the backward scales what the forward kept. A chunk's logits are as large as the hidden
states, whatever the vocabulary. Plain PyTorch: the same code on CPUs, GPUs and XLA.

It is exact to the model's own loss within fp32 rounding: the logits are made in the compute
dtype and upcast, as Transformers makes them, and the gradients are summed in fp32 across chunks.
It replaces the forward of the architectures whose logits are their output layer's, nothing
more (:data:`PLAIN_HEADS`: no soft-capping, no logit scale); any other keeps its own loss.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: Transformers' label of a token the loss skips
IGNORE_INDEX = -100

#: the causal-LM architectures (``model_type``) whose logits are their output layer applied to the
#: last hidden state, with no scale or cap after it (tests/test_causal_lm.py checks each)
PLAIN_HEADS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "phi3", "olmo2"})


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in here: autocast's, where it is on."""
    device = tensor.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return tensor.dtype


#: the fewest tokens a chunk takes: below it a small model's step pays for a loop of small matmuls
#: (the causal LM's small config on the CPU: 10% slower in 64-token chunks)
MIN_CHUNK_TOKENS = 1024


def chunk_length(tokens: int, vocabulary: int, hidden: int) -> int:
    """Tokens per chunk: as many chunks as the vocabulary is wider than the hidden states, so that a
    chunk's logits hold about as many values as the hidden states, and at least
    :data:`MIN_CHUNK_TOKENS` (all of them when there are fewer)."""
    chunks = max(1, math.ceil(vocabulary / hidden))
    return min(tokens, max(MIN_CHUNK_TOKENS, math.ceil(tokens / chunks)))


class LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden @ weight.T + bias, labels)`` (mean over the labels not ignored), its
    logits made chunk by chunk; the gradients are computed in the forward when any is needed."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
    ) -> torch.Tensor:
        dtype = compute_dtype(hidden)
        with torch.autocast(hidden.device.type, enabled=False):
            loss, grads = chunked_loss(hidden, weight, bias, labels, dtype, any(ctx.needs_input_grad[:3]))
        ctx.save_for_backward(*grads)
        ctx.has_bias = bias is not None
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, *grad_bias = ctx.saved_tensors
        scaled_bias = grad_bias[0] * grad_loss if ctx.has_bias else None
        return grad_hidden * grad_loss, grad_weight * grad_loss, scaled_bias, None


def chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    dtype: torch.dtype,
    with_grads: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The mean loss, and (``with_grads``) its gradients with respect to ``hidden``, ``weight`` and
    ``bias``, one chunk of tokens at a time: a chunk's logits, in ``dtype`` and upcast to fp32,
    become its softmax in place, minus one at each label, scaled by the label's share of the mean."""
    valid = labels != IGNORE_INDEX
    count = valid.sum().clamp_min(1).float()
    targets = labels.clamp_min(0).unsqueeze(1)
    weight_c = weight.to(dtype)
    bias_c = bias.to(dtype) if bias is not None else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden, grad_weight = [], torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
    step = chunk_length(hidden.shape[0], weight.shape[0], weight.shape[1])
    for start in range(0, hidden.shape[0], step):
        part = hidden[start : start + step].to(dtype)
        logits = F.linear(part, weight_c, bias_c).float()
        norm = torch.logsumexp(logits, dim=1, keepdim=True)
        share = valid[start : start + step].float()
        total = total + ((norm - logits.gather(1, targets[start : start + step])).squeeze(1) * share).sum()
        if with_grads:
            probs = logits.sub_(norm).exp_()
            probs.scatter_add_(1, targets[start : start + step], -torch.ones_like(norm))
            grad_logits = probs.mul_((share / count).unsqueeze(1)).to(dtype)
            grad_hidden.append(grad_logits @ weight_c)
            grad_weight += (grad_logits.t() @ part).float()
            if bias is not None:
                grad_bias += grad_logits.float().sum(0)
    if not with_grads:
        return total / count, []
    grads = [torch.cat(grad_hidden).to(hidden.dtype), grad_weight.to(weight.dtype)]
    return total / count, grads + ([grad_bias.to(bias.dtype)] if bias is not None else [])


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` (``IGNORE_INDEX``:
    skipped), over every leading dimension, without the logits."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return LinearCrossEntropy.apply(flat, weight, bias, labels.reshape(-1))


def fuse_loss(model: nn.Module) -> bool:
    """Give ``model`` (a Transformers causal LM) the fused loss where its head is plain
    (:data:`PLAIN_HEADS`): its forward, given ``labels``, returns the loss and no logits; without
    labels (generation) it is the model's own. False: the model keeps its loss."""
    head = model.get_output_embeddings()
    if model.config.model_type not in PLAIN_HEADS or not isinstance(head, nn.Linear):
        return False
    plain_forward = model.forward

    def forward(
        self: nn.Module, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, **kwargs: Any
    ):
        if labels is None:
            return plain_forward(input_ids=input_ids, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # each position predicts the next token
        return CausalLMOutputWithPast(loss=linear_cross_entropy(hidden, head.weight, shifted, head.bias))

    model.forward = types.MethodType(forward, model)  # a bound method, as wrappers (FSDPv2) check for
    return True
