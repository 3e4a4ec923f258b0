"""Transformers causal-LM architectures as users fine-tune them, each built tiny from its config:
tied and untied output layers, sliding-window attention, soft-capped logits, mixture-of-experts
layers. Each trains, checkpoints, resumes to the weights of an uninterrupted run and exports a
folder that Transformers loads with its tie in place and raytpu's evaluation logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raytpu.config import load_config
from raytpu.jobs.causal_lm import corpus
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.conftest import ROOT

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")
LAYERS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "max_position_embeddings": 64}  # fmt: skip
#: name -> (model_type, model_config): a window of 8 tokens is shorter than the 32-token blocks
ARCHITECTURES = {
    "gpt2": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}),  # tied by default
    "llama-tied": ("llama", {**LAYERS, "tie_word_embeddings": True}),  # Llama 3.2 1B / 3B
    "llama": ("llama", {**LAYERS, "tie_word_embeddings": False}),
    "qwen2": ("qwen2", {**LAYERS, "tie_word_embeddings": True}),  # Qwen2.5 0.5B - 3B
    "gemma2": ("gemma2", {**LAYERS, "head_dim": 16, "sliding_window": 8}),  # tied, soft-capped, sliding
    "mistral": ("mistral", {**LAYERS, "sliding_window": 8}),
    "phi3": ("phi3", LAYERS),
    "olmo2": ("olmo2", LAYERS),
    "qwen2_moe": ("qwen2_moe", {**LAYERS, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 32}),  # fmt: skip
}
#: 32-token blocks, a global batch of 4, a checkpoint every 2 steps
TINY = ["job.vocab_size=512", "job.seq_len=32", "data.global_batch_size=4", "checkpoint.every_steps=2",
        "loop.eval_every_steps=2", "loop.log_every=1", "logging.progress_bar=false", "job.sample_tokens=4",
        "data.eval_batch_size=8", "data.max_eval_samples=8", "checkpoint.num_to_keep=5"]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("architectures") / "data"
    corpus.synthesize(root, vocab_size=512)
    return root


def model_words(name: str) -> list[str]:
    """The architecture in place of the config's (its whole ``job.model_config``)."""
    model_type, fields = ARCHITECTURES[name]
    return [f"job.model_type={model_type}", f"job.model_config={json.dumps(fields)}"]


def fit(run_dir: Path, data: Path, name: str, *words: str) -> Trainer:
    cfg, job = load_config(SMALL, [f"data.path={data}", *TINY, *model_words(name), *words])
    trainer = Trainer(cfg, job, make_runtime("cpu", "fp32", 1, 0, 0), run_dir, data, FolderReporter(run_dir))
    trainer.fit()
    return trainer


def eval_logits(name: str, data: Path, checkpoint: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits raytpu's evaluation computes with ``checkpoint``'s weights."""
    cfg, job = load_config(SMALL, [f"data.path={data}", *TINY, *model_words(name)])
    model = job.build_model(cfg)
    ckpt.load_into(model, ckpt.load_model_weights(checkpoint))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_trains_resumes_and_exports(name, data, tmp_path):
    from transformers import AutoModelForCausalLM

    from raytpu import api

    straight = fit(tmp_path / "straight", data, name, "loop.max_steps=4")
    fit(tmp_path / "stopped", data, name, "loop.max_steps=2")
    resumed = fit(tmp_path / "stopped", data, name, "loop.max_steps=4")
    assert resumed.progress.step == 4
    final = tmp_path / "straight" / "checkpoint_00000004"
    expected = ckpt.load_model_weights(final)
    again = ckpt.load_model_weights(tmp_path / "stopped" / "checkpoint_00000004")
    assert again.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(again[key], expected[key], rtol=0, atol=0)

    model = straight.runtime.unwrap(straight.model)
    tied = ckpt.tied_names(model)
    assert not tied.keys() & expected.keys()  # a tied tensor is written once
    out = tmp_path / "export"
    overrides = [f"data.path={data}", *TINY, *model_words(name)]
    api.export(SMALL, *overrides, out=out, checkpoint=str(final))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert ckpt.tied_names(exported) == tied  # the tie in place
    ids = corpus.PackedBlocks(corpus.read_tokens(data, "valid"), 32)[0]["input_ids"][None]
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
    torch.testing.assert_close(theirs, eval_logits(name, data, final, ids), rtol=0, atol=1e-5)


def test_tied_models_are_the_ones_users_fine_tune():
    """The matrix holds tied models where their families tie (GPT-2, Llama 3.2, Qwen2.5, Gemma)."""
    from transformers import AutoConfig

    configs = {name: AutoConfig.for_model(kind, **fields) for name, (kind, fields) in ARCHITECTURES.items()}
    tied = {name for name, config in configs.items() if config.tie_word_embeddings}
    assert tied == {"gpt2", "llama-tied", "qwen2", "gemma2"}
