"""The causal LM's fused loss (``job.fused_loss``): the same loss and gradients as the model's own
for every architecture it is given to, in fp32 and under bf16 autocast, without the logits; the
others keep their own; ``--use_liger_kernel`` names it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from raytpu.config import load_config
from raytpu.config.memory import estimate_run
from raytpu.jobs.causal_lm import fused_loss
from raytpu.jobs.causal_lm.fused_loss import IGNORE_INDEX, PLAIN_HEADS, fuse_loss, linear_cross_entropy
from tests.conftest import ROOT

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
#: what some architectures call the fields of SHAPE, or need besides
OWN_FIELDS = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4},
    "gpt_neox": SHAPE,
    "phi3": {**SHAPE, "num_key_value_heads": 2, "pad_token_id": 0},
}


def twin_models(model_type: str):
    config = AutoConfig.for_model(
        model_type, vocab_size=1000, **OWN_FIELDS.get(model_type, {**SHAPE, "num_key_value_heads": 2})
    )
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(config)
    fused = AutoModelForCausalLM.from_config(config)
    fused.load_state_dict(plain.state_dict())
    assert fuse_loss(fused) and fused.forward.__func__ is not type(fused).forward  # a bound method of its own
    return plain, fused


def loss_and_grads(model, ids, labels, dtype=torch.float32):
    torch.manual_seed(1)  # the same dropout masks in both
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        output = model(input_ids=ids, labels=labels, use_cache=False)
    output.loss.backward()
    return output, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(PLAIN_HEADS))
def test_the_fused_loss_and_its_gradients_are_the_models_own(model_type):
    plain, fused = twin_models(model_type)
    ids = torch.randint(0, 1000, (3, 17))
    labels = ids.clone()
    labels[0, 5:9] = IGNORE_INDEX
    expected, expected_grads = loss_and_grads(plain, ids, labels)
    found, grads = loss_and_grads(fused, ids, labels)
    assert found.logits is None
    assert found.loss.item() == pytest.approx(expected.loss.item(), rel=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_under_bf16_autocast_it_stays_within_bf16_rounding_of_the_models_own():
    plain, fused = twin_models("llama")
    ids = torch.randint(0, 1000, (4, 32))
    expected, expected_grads = loss_and_grads(plain, ids, ids, torch.bfloat16)
    found, grads = loss_and_grads(fused, ids, ids, torch.bfloat16)
    assert found.loss.item() == pytest.approx(expected.loss.item(), rel=1e-3)
    for name, grad in grads.items():
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, expected_grads[name], rtol=0.05, atol=2e-3, msg=name)


def test_many_chunks_with_a_bias_match_cross_entropy(monkeypatch):
    """A vocabulary 50 times the width: 50 chunks of 2 tokens, each with its own gradients."""
    monkeypatch.setattr(fused_loss, "MIN_CHUNK_TOKENS", 1)
    assert fused_loss.chunk_length(100, 400, 8) == 2
    torch.manual_seed(0)
    hidden = torch.randn(2, 50, 8, requires_grad=True)
    weight = torch.randn(400, 8, requires_grad=True)
    bias = torch.randn(400, requires_grad=True)
    labels = torch.randint(0, 400, (2, 50))
    labels[1, :10] = IGNORE_INDEX
    fused = linear_cross_entropy(hidden, weight, labels, bias)
    (2 * fused).backward()
    fused_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for tensor in (hidden, weight, bias):
        tensor.grad = None
    plain = F.cross_entropy((hidden @ weight.t() + bias).reshape(-1, 400), labels.reshape(-1))
    (2 * plain).backward()
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)
    for found, expected in zip(fused_grads, (hidden.grad, weight.grad, bias.grad)):
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("vocabulary", [32000, 128256], ids=["llama2 32k", "llama3 128k"])
def test_at_the_vocabularies_people_train_with_the_loss_and_gradients_are_cross_entropy_s(monkeypatch, vocabulary):
    """Llama 2's and Llama 3's vocabularies in chunks of 16 tokens: the loss and the gradients of
    the hidden states and of the output layer equal the logits-then-cross-entropy ones."""
    monkeypatch.setattr(fused_loss, "MIN_CHUNK_TOKENS", 16)
    torch.manual_seed(0)
    hidden = torch.randn(2, 40, 16, requires_grad=True)
    weight = (torch.randn(vocabulary, 16) / 4).requires_grad_()
    labels = torch.randint(0, vocabulary, (2, 40))
    fused = linear_cross_entropy(hidden, weight, labels)
    fused.backward()
    fused_grads = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    plain = F.cross_entropy((hidden @ weight.t()).reshape(-1, vocabulary), labels.reshape(-1))
    plain.backward()
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)
    for found, expected in zip(fused_grads, (hidden.grad, weight.grad)):
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-7)


def test_evaluation_and_generation_keep_working():
    plain, fused = twin_models("llama")
    plain.eval(), fused.eval()
    ids = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        assert float(fused(input_ids=ids, labels=ids).loss) == pytest.approx(
            float(plain(input_ids=ids, labels=ids).loss), rel=1e-6
        )
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_model_whose_logits_are_more_than_its_head_keeps_its_own_loss():
    config = AutoConfig.for_model("gemma2", vocab_size=1000, **SHAPE, num_key_value_heads=2, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)  # its logits are soft-capped
    assert not fuse_loss(model) and "forward" not in vars(model)


def test_liger_s_flag_and_the_memory_it_saves():
    """``--use_liger_kernel`` turns it on (and off); the estimate of the 789 M shape's step drops by
    most of the logits' bytes, which lets a larger batch fit the same memory."""
    assert load_config(SMALL, ["--use_liger_kernel", "false"])[0].job.fused_loss is False
    assert load_config(SMALL, ["job.fused_loss=false", "--use_liger_kernel"])[0].job.fused_loss is True
    shape = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
             "intermediate_size": 5632, "max_position_embeddings": 2048}  # fmt: skip
    words = [f"job.model_config.{key}={value}" for key, value in shape.items()]
    words += ["job.seq_len=2048", "job.vocab_size=32000", "data.global_batch_size=8", "scaling.num_workers=1"]
    words += ["scaling.runtime=cuda", "scaling.precision=bf16", "loop.compile=true"]
    fused_cfg, job = load_config(SMALL, words)
    plain_cfg, _ = load_config(SMALL, [*words, "job.fused_loss=false"])
    fused, plain = estimate_run(fused_cfg, job), estimate_run(plain_cfg, job)
    logits = 8 * 2048 * 32000 * (4 + 4 + 2)
    assert plain.activations - fused.activations > 0.8 * logits
    larger, _ = load_config(SMALL, [*[w for w in words if "global_batch" not in w], "data.global_batch_size=10"])
    assert estimate_run(larger, job).total < plain.total
