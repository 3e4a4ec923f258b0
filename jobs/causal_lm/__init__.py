"""Causal language modelling with Hugging Face Transformers as a raytpu job.

Any Transformers causal-LM architecture (``job.model_type`` with ``job.model_config`` in
Transformers' own names, or a ``save_pretrained`` folder in ``job.model_name_or_path``), trained
on packed blocks of a tokenized corpus made on the machine (``raytpu.jobs.causal_lm.corpus``). The loss
is the model's own (``model(input_ids, labels=input_ids).loss``); validation reports the
held-out perplexity; ``raytpu export`` writes a folder ``from_pretrained`` loads.

Transformers is imported only inside the methods: importing it loads torch_xla when present,
which the runtime allows or not (``USE_TORCH_XLA``) before the model is built.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from raytpu.config import Config
from raytpu.config.args import Flag, parse_value
from raytpu.corpus.packing import TokenizerEncoder
from raytpu.job import Batch, Job, JobConfig, StepContext
from raytpu.jobs.causal_lm import corpus
from raytpu.jobs.causal_lm.fused_loss import PLAIN_HEADS, chunk_length, fuse_loss
from raytpu.worker.flops import matmul_parameters, transformer_flops_per_token


@dataclass(frozen=True)
class CausalLMConfig(JobConfig):
    name: str = "causal_lm"
    model_type: str = "llama"  # any causal-LM model_type of Transformers (llama, gpt2, qwen2, mistral, ...)
    model_config: dict[str, Any] = field(default_factory=dict)  # its config's fields, in Transformers' names
    model_name_or_path: str = ""  # a save_pretrained folder (config and weights) instead: fine-tuning
    attn_implementation: str = "causal"  # causal (SDPA, no mask: see causal_attention) | sdpa | eager
    gradient_checkpointing: bool = False
    fused_loss: bool = True  # the loss without the full logits where exact (fused_loss.py); --use_liger_kernel
    seq_len: int = 128  # tokens per packed block
    vocab_size: int = 4096  # entries of the tokenizer trained by `raytpu data synth causal_lm`
    corpus: str = ""  # "" = the pinned standard-library files; else a folder of .py/.txt/.md files
    # "" = the pretrained model's own (model_name_or_path), else one trained on the corpus; or a
    # save_pretrained folder (--tokenizer_name)
    tokenizer: str = ""
    prompt: str = "def "  # generated from at each evaluation (TensorBoard text)
    sample_tokens: int = 48  # tokens generated per evaluation (0 = none)


def architecture(job: CausalLMConfig) -> Any:  # -> transformers.PretrainedConfig
    """The model's Transformers config: from ``model_name_or_path``, or ``model_type`` and ``model_config``."""
    from transformers import AutoConfig

    if job.model_name_or_path:
        return AutoConfig.from_pretrained(job.model_name_or_path)
    fields = {"vocab_size": job.vocab_size, **typed_model_config(job)}
    return AutoConfig.for_model(job.model_type, **{**special_ids_outside(job.model_type, fields), **fields})


#: the token ids a Transformers config names, which its defaults give for the vocabulary it was made for
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_ids_outside(model_type: str, fields: dict[str, Any]) -> dict[str, None]:
    """The special token ids of ``model_type``'s defaults that a model built with ``fields``
    (their vocabulary) cannot embed, as None: GPT-2's 50256 or Phi-3's pad id 32000 in a
    vocabulary of 4,096 (an embedding's padding index out of range fails the build)."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    vocabulary = fields.get("vocab_size", defaults.vocab_size)
    outside = {}
    for name in SPECIAL_IDS:
        value = getattr(defaults, name, None)
        if name not in fields and isinstance(value, int) and value >= vocabulary:
            outside[name] = None
    return outside


def check_architecture(job: CausalLMConfig) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if job.model_name_or_path:
        if not (Path(job.model_name_or_path) / "config.json").is_file():
            raise ValueError(
                f"job.model_name_or_path={job.model_name_or_path!r} is not a save_pretrained folder (no config.json); "
                "raytpu never downloads models: pass a local folder"
            )
        return
    if job.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(job.model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"job.model_type={job.model_type!r} is not a Transformers causal-LM architecture{hint}")
    typed_model_config(job)


def typed_model_config(job: CausalLMConfig) -> dict[str, Any]:
    """``job.model_config`` checked against the fields of ``job.model_type``'s config class, each
    value typed as that class annotates it (an int where it takes a float becomes a float); an
    unknown field fails with the closest fields of that class."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[job.model_type]
    annotations = field_annotations(config_class)
    fields = set(annotations) | set(inspect.signature(config_class.__init__).parameters) | set(vars(config_class()))
    typed = {}
    for key, value in job.model_config.items():
        if key not in fields:
            close = difflib.get_close_matches(key, [k for k in fields if not k.startswith("_")], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"job.model_config.{key} is not a field of Transformers' {job.model_type} config{hint}")
        typed[key] = typed_value(f"job.model_config.{key}", value, annotations.get(key), config_class.__name__)
    return typed


#: the annotations :func:`typed_value` checks a value against
PLAIN_TYPES = {bool, int, float, str, type(None)}


def field_annotations(config_class: type) -> dict[str, Any]:
    """The annotated fields of a Transformers config class and its bases (Transformers 5 declares them)."""
    annotations: dict[str, Any] = {}
    for cls in reversed(config_class.__mro__):
        annotations.update(vars(cls).get("__annotations__", {}))
    return annotations


def typed_value(key: str, value: Any, annotation: Any, owner: str) -> Any:
    """``value`` as ``annotation`` types it, where that is plain (bool, int, float, str, None);
    other annotations (mappings, lists, literals) take the value as YAML read it."""
    kinds = set(typing.get_args(annotation)) or {annotation}
    if not kinds <= PLAIN_TYPES:
        return value
    if isinstance(value, str) and str not in kinds and float in kinds:
        with contextlib.suppress(ValueError):
            return float(value)  # YAML 1.1 reads 1e-5 as a string
    if value is None:
        fits = type(None) in kinds
    elif isinstance(value, bool):
        fits = bool in kinds
    elif isinstance(value, int) and int not in kinds and float in kinds:
        return float(value)
    else:
        fits = type(value) in kinds
    if fits:
        return value
    wanted = " or ".join(sorted(kind.__name__ for kind in kinds))
    raise ValueError(f"{key} must be {wanted} (as Transformers' {owner} types it), got {value!r}")


def config_overrides(value: Any) -> list[tuple[str, Any]]:
    """``run_clm.py``'s ``--config_overrides "n_embd=64,resid_pdrop=0.2"``: fields of the model's
    Transformers config, as ``job.model_config.<field>`` overrides (values read as YAML)."""
    pairs = []
    for item in str(value).split(","):
        name, sep, text = item.strip().partition("=")
        if not sep or not name.strip() or not text.strip():
            raise ValueError(f"--config_overrides {value}: write FIELD=VALUE pairs separated by commas, e.g. n_embd=64")
        pairs.append((f"job.model_config.{name.strip()}", parse_value(text.strip())))
    return pairs


#: bytes an eager decoder layer saves for its backward per token, per hidden and per intermediate
#: unit, by the compute dtype's width: fp32 keeps 9 hidden-wide and 4 intermediate-wide values; bf16
#: keeps 8 and 4 in bf16 beside the norms' fp32 upcasts (measured on the CPU with autograd's
#: saved-tensor hooks, Llama shapes: tests/test_causal_lm.py checks it)
EAGER_LAYER_BYTES = {4: (36, 16), 2: (40, 10)}


def context_length(config: Any) -> int | None:
    """The longest sequence the architecture's positions allow (None: no limit declared)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


class CausalLMJob(Job):
    name = "causal_lm"
    config_class = CausalLMConfig
    main_metric = "perplexity"
    main_metric_mode = "min"
    aliases = {
        "--model_name_or_path": "job.model_name_or_path",
        "--block_size": "job.seq_len",  # Transformers' run_clm.py
        "--model_type": "job.model_type",
        "--config_overrides": Flag(convert=config_overrides, text=True, sets="job.model_config (run_clm.py: k=v,k=v)"),
        "--use_liger_kernel": Flag(key="job.fused_loss", switch=True),  # TrainingArguments': the same fused loss
        "--tokenizer_name": "job.tokenizer",  # run_clm.py's: a save_pretrained folder
    }
    requires = ("transformers", "tokenizers")

    # ----------------------------------------------------------------- build
    def check_config(self, cfg: Config) -> None:
        job = cfg.job
        if job.seq_len < 2:
            raise ValueError(f"job.seq_len must be at least 2 (a token and its successor), got {job.seq_len}")
        if job.attn_implementation not in ATTENTION:
            choices = ", ".join(ATTENTION)
            raise ValueError(f"job.attn_implementation={job.attn_implementation!r} is not one of {choices}")
        check_architecture(job)
        limit = context_length(architecture(job))
        if limit is not None and job.seq_len > limit:
            raise ValueError(f"job.seq_len={job.seq_len} exceeds the model's {limit} positions; lower job.seq_len")

    def build_model(self, cfg: Config) -> nn.Module:
        from transformers import AutoModelForCausalLM

        job = cfg.job
        config = architecture(job)
        attention = attention_for(job, config)
        if job.model_name_or_path:
            model = AutoModelForCausalLM.from_pretrained(
                job.model_name_or_path, attn_implementation=attention, dtype=torch.float32
            )
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        if job.gradient_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        if job.fused_loss:
            fuse_loss(model)
        return model

    def build_dataset(self, cfg: Config, split: str, data_root: Path) -> Dataset:
        tokens = corpus.read_tokens(data_root, split)
        vocabulary = corpus.vocabulary_size(data_root)
        embeddings = cfg.job.vocab_size if not cfg.job.model_name_or_path else vocabulary
        if vocabulary > embeddings:
            raise ValueError(
                f"the tokenizer in {data_root} has {vocabulary} entries but the model embeds {embeddings}; "
                f"set job.vocab_size={vocabulary} or make the data again"
            )
        return corpus.PackedBlocks(tokens, cfg.job.seq_len)

    # --------------------------------------------- a corpus of the user's (data.train_files)
    def block_length(self, cfg: Config) -> int:
        return cfg.job.seq_len

    def default_text(self, cfg: Config) -> tuple[list[str], list[str]]:
        """The made-up corpus as files (``data.loader=ray`` without ``data.train_files``): the pinned
        standard-library files of each split, or ``job.corpus`` with a held-out share."""
        if cfg.job.corpus:
            return [cfg.job.corpus], []
        files = corpus.stdlib_files()
        return [str(path) for path in files["train"]], [str(path) for path in files["valid"]]

    def text_encoder(
        self, cfg: Config, data_root: Path, texts: Callable[[], Iterator[str]], source: str
    ) -> TokenizerEncoder:
        """The tokenizer of ``job.tokenizer``, of the pretrained model, or trained on ``texts``
        into ``data_root``; refused when the model cannot embed every id it gives."""
        job = cfg.job
        folder = corpus.tokenizer_folder(job.tokenizer, job.model_name_or_path, data_root)
        encoder = TokenizerEncoder.of(corpus.corpus_tokenizer(folder, data_root, texts, source, job.vocab_size))
        embeddings = architecture(job).vocab_size
        if encoder.vocab_size > embeddings:
            fix = (
                "give the model's own tokenizer"
                if job.model_name_or_path
                else f"set job.vocab_size={encoder.vocab_size}"
            )
            raise ValueError(
                f"the tokenizer in {folder} has {encoder.vocab_size} entries but the model embeds {embeddings}; {fix}"
            )
        return encoder

    def flops_per_sample(self, cfg: Config, model: nn.Module) -> float | None:
        """PaLM's count for one block: (6 N + 12 L d T) per token, times T tokens."""
        config, seq_len = model.config, cfg.job.seq_len
        layers, width = config.num_hidden_layers, config.hidden_size
        return float(transformer_flops_per_token(matmul_parameters(model), layers, width, seq_len) * seq_len)

    def tokens_per_sample(self, cfg: Config) -> int | None:
        return cfg.job.seq_len

    def activation_bytes(
        self, cfg: Config, batch: int, value_bytes: int, checkpointed: bool, compiled: bool = False
    ) -> float:
        """What a step holds for its backward at its peak, the backward's start: every decoder
        layer's saved values, the loss's fp32 log-probabilities and, beside them, their gradient in
        fp32 and in the compute dtype (fused: one chunk's logits and their gradient, and the
        gradients of the hidden states and of the output layer in fp32). Per token and layer,
        eager: the bytes per hidden and per intermediate unit autograd saves
        (:data:`EAGER_LAYER_BYTES`, measured on the CPU with its saved-tensor hooks:
        ``tests/test_sharding.py``); compiled, torch.compile's partitioner
        recomputes the pointwise ops (the norms' fp32 upcasts, the activation): the residual stream
        at both norms, q, k and v (k and v of the key-value heads), the attention output, gate, up
        and their product, each in the compute dtype; in fp8 (float8 linear layers) the MLP's in
        1 byte, attention's in bf16 (an H200 measured 22.8 GB where this counts 23.6). Checkpointed,
        a layer keeps its input, and one layer's activations are recomputed at a time."""
        config = architecture(cfg.job)
        hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        tokens = batch * cfg.job.seq_len
        if compiled:
            heads = config.num_attention_heads
            kv_share = getattr(config, "num_key_value_heads", heads) / heads
            mlp_bytes = 1 if cfg.scaling.precision == "fp8" else value_bytes
            per_layer = tokens * (value_bytes * (4 + 2 * kv_share) * hidden + mlp_bytes * 3 * inner)
        else:
            per_hidden, per_inner = EAGER_LAYER_BYTES[value_bytes]
            per_layer = tokens * (per_hidden * hidden + per_inner * inner)
        kept = tokens * value_bytes * hidden * layers + per_layer if checkpointed else per_layer * layers
        vocabulary = cfg.job.vocab_size if not cfg.job.model_name_or_path else config.vocab_size
        if cfg.job.fused_loss and config.model_type in PLAIN_HEADS:
            chunk = chunk_length(tokens, vocabulary, hidden)
            loss = chunk * vocabulary * (4 + value_bytes) + tokens * hidden * 4 + vocabulary * hidden * 4
        else:
            loss = tokens * vocabulary * (4 + 4 + value_bytes)
        return float(kept + loss)

    def synthesize(self, out: Path, vocab_size: int = 4096, corpus_dir: str = "", tokenizer: str = "") -> None:
        """``raytpu data synth causal_lm --out DIR [--vocab-size N] [--corpus-dir DIR] [--tokenizer DIR]``."""
        corpus.synthesize(out, vocab_size=vocab_size, corpus=corpus_dir, tokenizer=tokenizer)

    def synth_options(self, cfg: Config) -> dict[str, Any]:
        job = cfg.job
        return {"vocab_size": job.vocab_size, "corpus_dir": job.corpus, "tokenizer": job.tokenizer}

    # ------------------------------------------------------------------ step
    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        ids = batch["input_ids"]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        return loss, {"loss": loss}

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        """The model's mean loss times the tokens it predicts (all blocks have as many), summed."""
        ids = batch["input_ids"]
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss.float()
        predicted = torch.full_like(loss, ids.shape[0] * (ids.shape[1] - 1))
        return {"nll_sum": loss * predicted, "tokens": predicted}

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        loss = float(totals["nll_sum"] / totals["tokens"].clamp_min(1))
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    def eval_text(self, model: nn.Module, ctx: StepContext, data_root: Path) -> dict[str, str]:
        """Greedy continuation of ``job.prompt`` (TensorBoard text at each evaluation)."""
        job = ctx.config.job
        if not job.sample_tokens:
            return {}
        tokenizer = corpus.load_tokenizer(corpus.tokenizer_folder(job.tokenizer, job.model_name_or_path, data_root))
        return {"sample": generate(model, tokenizer, job.prompt, job.sample_tokens)}

    # ---------------------------------------------------------------- export
    def export(self, model: nn.Module, cfg: Config, data_root: Path, out: Path) -> None:
        """A folder ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load."""
        job = cfg.job
        tokenizer = corpus.load_tokenizer(corpus.tokenizer_folder(job.tokenizer, job.model_name_or_path, data_root))
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        if model.config._attn_implementation == ATTENTION["causal"]:  # raytpu's name, unknown to other installs
            model.set_attn_implementation("sdpa")  # the same kernel, with the mask Transformers builds
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))


#: job.attn_implementation -> Transformers' name
ATTENTION = {"causal": "raytpu_causal", "sdpa": "sdpa", "eager": "eager"}


def attention_implementation(name: str) -> str:
    """Transformers' attention for ``job.attn_implementation``. ``causal`` is its SDPA kernel
    registered under a name of its own with no mask function: the mask is never built, and SDPA
    runs with ``is_causal`` (exact for unpadded packed blocks). Transformers' own ``sdpa`` first
    checks ``position_ids`` for packed sequences with a data-dependent branch: a host sync in
    every step on XLA."""
    from transformers import AttentionInterface

    if name == "causal":
        AttentionInterface.register(ATTENTION[name], causal_attention)
    return ATTENTION[name]


def attention_for(job: CausalLMConfig, config: Any) -> str | None:
    """Transformers' attention for the job's model: ``causal`` only where it computes what the
    architecture does over a whole block (else None: the architecture's own choice, which builds
    the mask it needs)."""
    if job.attn_implementation == "causal" and not plain_causal(config, job.seq_len):
        return None
    return attention_implementation(job.attn_implementation)


def plain_causal(config: Any, seq_len: int) -> bool:
    """Whether every layer of the architecture attends causally to the whole block with SDPA, as
    the ``causal`` kernel does: not where a layer's sliding window is shorter than the block
    (Mistral, Gemma 2 and 3), scores are soft-capped (Gemma 2), or the model has no SDPA path."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None or not getattr(model_class, "_supports_sdpa", False):
        return False
    if getattr(config, "attn_logit_softcapping", None):
        return False
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    sliding = "sliding_attention" in layer_types if layer_types else getattr(config, "use_sliding_window", True)
    return not (sliding and 0 < window < seq_len)


def causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
    """Transformers' SDPA attention with its operands in one dtype: under autocast the rotary
    embedding leaves the query and key in float32 while the value projection is in the autocast
    dtype, and autocasts that do not list SDPA (XLA's) pass the mix on, which SDPA rejects."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query.to(value.dtype), key.to(value.dtype), value, *args, **kwargs)


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompt: str, tokens: int) -> str:
    """Greedy continuation of ``prompt`` in one fixed shape: the prompt and ``tokens`` pad slots in
    one row, the whole row through the model at each position (causal attention: a position sees
    none after it), the next token read back and written into its slot. Every step is the same
    graph on XLA, compiled once for all evaluations, where Transformers' ``generate`` grows its
    inputs by a token a step and compiles two to three graphs per token."""
    device = next(model.parameters()).device
    prompt_ids = tokenizer(prompt)["input_ids"]
    row = torch.full((1, len(prompt_ids) + tokens), tokenizer.pad_token_id, dtype=torch.long)
    row[0, : len(prompt_ids)] = torch.tensor(prompt_ids)
    for position in range(len(prompt_ids) - 1, row.shape[1] - 1):
        logits = model(input_ids=row.to(device), use_cache=False).logits
        at = torch.tensor([position]).to(device)  # an input of the graph, not a constant in it
        row[0, position + 1] = logits.index_select(1, at).argmax(-1).cpu()
    return tokenizer.decode(row[0].tolist())


JOB = CausalLMJob()
