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

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from raytpu.config import Config
from raytpu.config.args import Flag
from raytpu.corpus.packing import TokenizerEncoder
from raytpu.job import Batch, Job, JobConfig, StepContext, empty_build, reads_weights_from, weights_arrive_later
from raytpu.jobs.causal_lm import corpus, hub, sft
from raytpu.jobs.causal_lm.attention import ATTENTION, attention_for, check_attention
from raytpu.jobs.causal_lm.configs import (
    DTYPES,
    architecture,
    check_architecture,
    config_overrides,
    context_length,
    expert_parameters,
    mlp_width,
    names,
    routed_share,
)
from raytpu.jobs.causal_lm.fused_loss import PLAIN_HEADS, chunk_length, fuse_loss
from raytpu.jobs.causal_lm.lora import check_lora, with_lora
from raytpu.worker.flops import matmul_parameters, transformer_flops_per_token


@dataclass(frozen=True)
class CausalLMConfig(JobConfig):
    name: str = "causal_lm"
    model_type: str = "llama"  # any causal-LM model_type of Transformers (llama, gpt2, qwen2, mistral, ...)
    model_config: dict[str, Any] = field(default_factory=dict)  # its config's fields, in Transformers' names
    model_name_or_path: str = ""  # a Hub name (org/name) or a save_pretrained folder instead: fine-tuning
    config_name: str = ""  # a Hub name or folder of a config to build the model from (run_clm.py's from scratch)
    revision: str = "main"  # the Hub revision (branch, tag or commit) of the model, its config and tokenizer
    dtype: str = "float32"  # the pretrained weights' dtype in memory: float32 | bfloat16 | float16 | auto
    trust_remote_code: bool = False  # run a Hub repository's own modeling code (only when set)
    cache_dir: str = ""  # "" = the Hugging Face cache (HF_HOME / HF_HUB_CACHE)
    attn_implementation: str = "causal"  # causal (SDPA, no mask: attention.py) | sdpa | eager | flex_attention ...
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
    # fine-tuning on rows (conversations, prompt-completion; TRL's SFTConfig names): sft.py
    packing: bool = False  # rows packed best-fit into job.seq_len (bfd), attention kept inside each document
    assistant_only_loss: bool = False  # the loss on the assistant's tokens alone (the template's generation marks)
    completion_only_loss: bool = True  # prompt-completion rows: the loss on the completion alone
    chat_template_path: str = ""  # a Jinja file, or a tokenizer (Hub name or folder), whose chat template is used
    # LoRA adapters (peft; TRL's ModelConfig names): the base frozen, the adapters trained
    use_peft: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=list)  # [] = peft's for the architecture; all-linear
    lora_modules_to_save: list[str] = field(default_factory=list)  # modules trained whole beside the adapters
    export_merged: bool = False  # raytpu export --merged: the adapters merged into the base (Transformers alone)


#: bytes an eager decoder layer saves for its backward per token, per hidden and per intermediate
#: unit, by the compute dtype's width: fp32 keeps 9 hidden-wide and 4 intermediate-wide values; bf16
#: keeps 8 and 4 in bf16 beside the norms' fp32 upcasts (measured on the CPU with autograd's
#: saved-tensor hooks, Llama shapes: tests/test_causal_lm.py checks it)
EAGER_LAYER_BYTES = {4: (36, 16), 2: (40, 10)}


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
        "--tokenizer_name": "job.tokenizer",  # run_clm.py's: a Hub name or a save_pretrained folder
        "--config_name": "job.config_name",
        "--model_revision": "job.revision",  # run_clm.py's name; TRL's ModelConfig: --model_revision too
        "--revision": "job.revision",
        "--dtype": "job.dtype",
        "--torch_dtype": "job.dtype",  # the older name of --dtype
        "--trust_remote_code": Flag(key="job.trust_remote_code", switch=True),
        "--attn_implementation": "job.attn_implementation",
        "--cache_dir": "job.cache_dir",
        "--max_length": "job.seq_len",  # TRL's SFTConfig
        "--packing": Flag(key="job.packing", switch=True),
        "--assistant_only_loss": Flag(key="job.assistant_only_loss", switch=True),
        "--completion_only_loss": Flag(key="job.completion_only_loss", switch=True),
        "--chat_template_path": "job.chat_template_path",
        "--dataset_text_field": "data.text_column",
        "--use_peft": Flag(key="job.use_peft", switch=True),
        "--lora_r": "job.lora_r",
        "--lora_alpha": "job.lora_alpha",
        "--lora_dropout": "job.lora_dropout",
        "--lora_target_modules": Flag(
            convert=names("job.lora_target_modules"), text=True, sets="job.lora_target_modules"
        ),
        "--lora_modules_to_save": Flag(
            convert=names("job.lora_modules_to_save"), text=True, sets="job.lora_modules_to_save"
        ),
        "--merged": Flag(key="job.export_merged", switch=True),
        "--low_cpu_mem_usage": Flag(
            switch=True, ignored="Transformers 5 always loads a pretrained model so (its weights straight into place)"
        ),
    }
    requires = ("transformers", "tokenizers")

    def replaced_in_file(self, in_file: dict[str, Any], typed: dict[str, Any]) -> set[str]:
        """A model named on the command line (``--model_name_or_path``, ``--config_name``, or another
        ``--model_type`` than the file's) is the model: the file's ``model_config`` fields were for
        the file's model (``--config_overrides`` and ``job.model_config.*`` typed still apply)."""
        other_type = str(typed.get("model_type", "")) not in ("", in_file.get("model_type", CausalLMConfig.model_type))
        named = typed.get("model_name_or_path") or typed.get("config_name")
        return {"model_config"} if other_type or named else set()

    # ----------------------------------------------------------------- build
    def check_config(self, cfg: Config) -> None:
        job = cfg.job
        if job.seq_len < 2:
            raise ValueError(f"job.seq_len must be at least 2 (a token and its successor), got {job.seq_len}")
        check_attention(job.attn_implementation)
        check_architecture(job)
        limit = context_length(architecture(job))
        if limit is not None and job.seq_len > limit:
            raise ValueError(f"job.seq_len={job.seq_len} exceeds the model's {limit} positions; lower job.seq_len")
        check_lora(cfg)
        if job.use_peft:  # the adapters on the architecture built empty: a target no module matches, now
            with empty_build():
                self.build_model(cfg)

    def build_model(self, cfg: Config) -> nn.Module:
        from transformers import AutoModelForCausalLM

        job = cfg.job
        config = architecture(job)
        attention = attention_for(job, config)
        if job.model_name_or_path and not weights_arrive_later():
            model = hub.load_model(
                job.model_name_or_path, hub.options(job), attn_implementation=attention, dtype=DTYPES[job.dtype]
            )
        elif job.model_name_or_path:  # the pretrained architecture, its weights read later or sent by rank 0
            dtype = DTYPES[job.dtype] if job.dtype != "auto" else getattr(config, "dtype", None) or torch.float32
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
            if not cfg.checkpoint.weights:  # else the run starts from those
                reads_weights_from(model, lambda: hub.weight_files(job.model_name_or_path, hub.options(job)))
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
        if job.gradient_checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        if job.fused_loss:
            fuse_loss(model)
        return with_lora(model, job) if job.use_peft else model

    def build_dataset(self, cfg: Config, split: str, data_root: Path) -> Dataset:
        rows = Path(data_root) / f"sft-{'valid' if split == 'test' else split}"
        if rows.is_dir():  # rows of conversations or prompts, or packed documents (sft.py)
            tokenizer = run_tokenizer(cfg.job, data_root)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            return sft.Rows(rows, cfg.job.seq_len, pad)
        tokens = corpus.read_tokens(data_root, split)
        vocabulary = corpus.vocabulary_size(data_root)
        embeddings = cfg.job.vocab_size if not cfg.job.model_name_or_path else vocabulary
        if vocabulary > embeddings:
            raise ValueError(
                f"the tokenizer in {data_root} has {vocabulary} entries but the model embeds {embeddings}; "
                f"set job.vocab_size={vocabulary} or make the data again"
            )
        return corpus.PackedBlocks(tokens, cfg.job.seq_len)

    # --------------------------------------------- rows to fine-tune on (sft.py)
    def takes_records(self, cfg: Config, first: dict[str, Any]) -> bool:
        """Conversations or prompt-completion rows; plain text too when ``job.packing`` asks for its
        documents packed apart (else run_clm.py's joined blocks)."""
        return "messages" in first or "prompt" in first or cfg.job.packing

    def prepare_records(self, cfg: Config, data_root: Path, sources: Any) -> None:
        job = cfg.job
        tokenizer, how = rows_tokenizer(cfg, data_root)
        made = sft.prepare(data_root, sources, tokenizer, how, job.seq_len, job.packing)
        cut = made["splits"]["train"]["truncated"]
        if cut:
            print(
                f"raytpu: {cut} training example(s) longer than job.seq_len={job.seq_len} tokens were cut", flush=True
            )

    def row_encoder(self, cfg: Config, data_root: Path) -> sft.StreamedRows:
        tokenizer, how = rows_tokenizer(cfg, data_root)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return sft.StreamedRows(tokenizer, how, cfg.job.packing, pad)

    def stream_records(self, cfg: Config, data_root: Path, sources: Any) -> None:
        sft.check_stream(data_root, sources, self.row_encoder(cfg, data_root), cfg.job.seq_len)

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
        folder = corpus.tokenizer_source(job.tokenizer, job.model_name_or_path, data_root)
        tokenizer = corpus.corpus_tokenizer(folder, data_root, texts, source, job.vocab_size, hub.options(job))
        encoder = TokenizerEncoder.of(tokenizer)
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
        """PaLM's count for one block: (6 N + 12 L d T) per token, times T tokens; of a
        mixture-of-experts layer's experts, N counts the share a token goes through."""
        config, seq_len = model.config, cfg.job.seq_len
        layers, width = config.num_hidden_layers, config.hidden_size
        active = matmul_parameters(model) - expert_parameters(model) * (1 - routed_share(config))
        return float(transformer_flops_per_token(round(active), layers, width, seq_len) * seq_len)

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
        hidden, inner, layers = config.hidden_size, mlp_width(config), config.num_hidden_layers
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
        source = corpus.tokenizer_source(job.tokenizer, job.model_name_or_path, cfg.data.path)
        own = "" if Path(source) == Path(cfg.data.path) else source  # the pretrained model's, or one named
        return {"vocab_size": job.vocab_size, "corpus_dir": job.corpus, "tokenizer": own}

    # ------------------------------------------------------------------ step
    def train_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> tuple[torch.Tensor, Batch]:
        loss = forward(model, batch).loss
        return loss, {"loss": loss}

    def loss_items(self, batch: Batch) -> torch.Tensor | None:
        """The tokens a fine-tuning batch trains on (its labels not masked out), which vary from batch
        to batch; a text block trains on all its tokens but the first, as many as any other's."""
        return (batch["labels"][:, 1:] != -100).sum() if "labels" in batch else None

    def eval_step(self, model: nn.Module, batch: Batch, ctx: StepContext) -> Batch:
        """The model's mean loss times the tokens it predicts, summed."""
        loss = forward(model, batch).loss.float()
        if "labels" in batch:  # the labels the loss takes: each predicts from the token before it
            predicted = self.loss_items(batch).to(loss.dtype)
        else:  # every block predicts as many
            ids = batch["input_ids"]
            predicted = torch.full_like(loss, ids.shape[0] * (ids.shape[1] - 1))
        return {"nll_sum": loss * predicted, "tokens": predicted}

    def finish_eval(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        loss = float(totals["nll_sum"] / totals["tokens"].clamp_min(1))
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    def eval_text(self, model: nn.Module, ctx: StepContext, data_root: Path) -> dict[str, str]:
        """Greedy continuation of ``job.prompt`` (TensorBoard text at each evaluation); of a
        fine-tuning run, of the first held-out rows' prompts (what precedes their first trained token:
        a conversation through the chat template up to the assistant's turn)."""
        job = ctx.config.job
        if not job.sample_tokens:
            return {}
        tokenizer = run_tokenizer(job, data_root)
        rows = Path(data_root) / (sft.STREAMED if ctx.config.data.loader == "ray" else "sft-valid")
        if not rows.is_dir():
            return {"sample": generate(model, tokenizer, job.prompt, job.sample_tokens)}
        prompts = sft.held_out_prompts(rows, SAMPLED_PROMPTS)
        return {f"sample_{i}": generate(model, tokenizer, ids, job.sample_tokens) for i, ids in enumerate(prompts)}

    # ---------------------------------------------------------------- export
    def export(self, model: nn.Module, cfg: Config, data_root: Path, out: Path) -> None:
        """A folder ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load."""
        job = cfg.job
        tokenizer = run_tokenizer(job, data_root)
        tokenizer.chat_template = chat_template(job, tokenizer)
        if job.use_peft and job.export_merged:  # the base with the adapters in it: Transformers loads it alone
            model = model.merge_and_unload()
        base = model.get_base_model() if job.use_peft and not job.export_merged else model
        base.generation_config.pad_token_id = tokenizer.pad_token_id
        base.generation_config.eos_token_id = tokenizer.eos_token_id
        if base.config._attn_implementation == ATTENTION["causal"]:  # raytpu's name, unknown to other installs
            # the same attention, with the mask Transformers builds (soft-capped scores: its eager kernel)
            base.set_attn_implementation("sdpa" if getattr(type(base), "_supports_sdpa", False) else "eager")
        model.save_pretrained(str(out))  # a PeftModel: the adapter folder PeftModel.from_pretrained loads
        tokenizer.save_pretrained(str(out))


def forward(model: nn.Module, batch: Batch) -> Any:
    """The model on a batch of blocks (every token a label), or of rows (their labels, positions in
    their documents, and attention kept inside each document)."""
    ids = batch["input_ids"]
    if "labels" not in batch:
        return model(input_ids=ids, labels=ids, use_cache=False)
    mask = sft.document_mask(batch["segments"])
    return model(input_ids=ids, labels=batch["labels"], position_ids=batch["position_ids"], attention_mask=mask,
                 use_cache=False)  # fmt: skip


def chat_template(job: CausalLMConfig, tokenizer: Any) -> str | None:
    """``job.chat_template_path``'s template (a Jinja file, or a tokenizer's), else the tokenizer's own."""
    source = job.chat_template_path
    if not source:
        return tokenizer.chat_template
    if Path(source).is_file():
        return Path(source).read_text()
    return hub.load_tokenizer(source, hub.options(job), "job.chat_template_path").chat_template


def rows_tokenizer(cfg: Config, data_root: Path) -> tuple[Any, sft.Tokenizing]:
    """The tokenizer rows are fine-tuned with (the model's own, or one named: never one trained on
    the rows) and how it tokenizes them."""
    job = cfg.job
    if Path(corpus.tokenizer_source(job.tokenizer, job.model_name_or_path, data_root)) == Path(data_root):
        raise ValueError(
            "fine-tuning on rows (conversations, prompts and completions, or --packing) takes the model's own "
            "tokenizer (--model_name_or_path) or one named with --tokenizer_name"
        )
    tokenizer = run_tokenizer(job, data_root)
    how = sft.Tokenizing(cfg.data.text_column, job.assistant_only_loss, job.completion_only_loss,
                         chat_template(job, tokenizer))  # fmt: skip
    return tokenizer, how


def run_tokenizer(job: CausalLMConfig, data_root: Path) -> Any:
    """The run's tokenizer: ``job.tokenizer``, the pretrained model's, or the one made with the data."""
    source = corpus.tokenizer_source(job.tokenizer, job.model_name_or_path, data_root)
    return corpus.run_tokenizer(source, data_root, hub.options(job))


#: held-out prompts a fine-tuning run continues at each evaluation
SAMPLED_PROMPTS = 2


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Any, prompt: str | list[int], tokens: int) -> str:
    """Greedy continuation of ``prompt`` in one fixed shape: the prompt and ``tokens`` pad slots in
    one row, the whole row through the model at each position (causal attention: a position sees
    none after it), the next token read back and written into its slot. Every step is the same
    graph on XLA, compiled once for all evaluations, where Transformers' ``generate`` grows its
    inputs by a token a step and compiles two to three graphs per token."""
    device = next(model.parameters()).device
    prompt_ids = tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else prompt
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    row = torch.full((1, len(prompt_ids) + tokens), pad, dtype=torch.long)
    row[0, : len(prompt_ids)] = torch.tensor(prompt_ids)
    for position in range(len(prompt_ids) - 1, row.shape[1] - 1):
        logits = model(input_ids=row.to(device), use_cache=False).logits
        at = torch.tensor([position]).to(device)  # an input of the graph, not a constant in it
        row[0, position + 1] = logits.index_select(1, at).argmax(-1).cpu()
    return tokenizer.decode(row[0].tolist())


JOB = CausalLMJob()
