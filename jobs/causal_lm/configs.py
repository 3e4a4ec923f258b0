"""The causal LM's Transformers config, as the job's keys describe it: a pretrained model's
(``job.model_name_or_path``), a config of the Hub or a folder (``job.config_name``) with
``job.model_config``'s fields over it, or ``job.model_type`` with ``job.model_config`` (each field
typed as its config class annotates it)."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import typing
from typing import Any

import torch

from raytpu.config.args import parse_value
from raytpu.jobs.causal_lm import hub


def architecture(job: Any) -> Any:  # -> transformers.PretrainedConfig
    """The model's Transformers config: from ``model_name_or_path``; from ``config_name`` with
    ``model_config``'s fields over it; or ``model_type`` and ``model_config``."""
    from transformers import AutoConfig

    if job.model_name_or_path:
        return hub.load_config(job.model_name_or_path, hub.options(job))
    if job.config_name:
        config = hub.load_config(job.config_name, hub.options(job), "job.config_name")
        config.update(typed_model_config(job, config.model_type))
        return config
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


def check_architecture(job: Any) -> None:
    if job.dtype not in DTYPES:
        raise ValueError(f"job.dtype={job.dtype!r} is not one of {', '.join(DTYPES)}")
    if job.model_name_or_path or job.config_name:
        architecture(job)  # read now: a name the Hub or its cache lacks is one line before any worker
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if job.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(job.model_type, list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"job.model_type={job.model_type!r} is not a Transformers causal-LM architecture{hint}")
    typed_model_config(job)


#: job.dtype -> the dtype ``from_pretrained`` holds the weights in
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def typed_model_config(job: Any, model_type: str = "") -> dict[str, Any]:
    """``job.model_config`` checked against the fields of the config class of ``model_type``
    (default ``job.model_type``), each value typed as that class annotates it (an int where it
    takes a float becomes a float); an unknown field fails with the closest fields of that class."""
    from transformers import CONFIG_MAPPING

    model_type = model_type or job.model_type
    config_class = CONFIG_MAPPING[model_type]
    annotations = field_annotations(config_class)
    fields = set(annotations) | set(inspect.signature(config_class.__init__).parameters) | set(vars(config_class()))
    typed = {}
    for key, value in job.model_config.items():
        if key not in fields:
            close = difflib.get_close_matches(key, [k for k in fields if not k.startswith("_")], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"job.model_config.{key} is not a field of Transformers' {model_type} config{hint}")
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


def context_length(config: Any) -> int | None:
    """The longest sequence the architecture's positions allow (None: no limit declared)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def routed_share(config: Any) -> float:
    """The share of a mixture-of-experts layer's experts each token goes through (1: a dense model)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    chosen = getattr(config, "num_experts_per_tok", None)
    return chosen / experts if experts and chosen else 1.0


def expert_parameters(model: Any) -> int:
    """The weights of the routed experts (modules named ``experts``: Transformers' MoE blocks)."""
    return sum(
        p.numel() for name, module in model.named_modules() if name.endswith(".experts") for p in module.parameters()
    )


def mlp_width(config: Any) -> int:
    """The intermediate units a token's MLP computes: the dense MLP's (GPT-2's ``n_inner``, else 4 x
    its width), or its chosen experts' and a shared expert's."""
    dense = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    if routed_share(config) == 1.0:
        return dense
    per_expert = getattr(config, "moe_intermediate_size", None) or dense
    return config.num_experts_per_tok * per_expert + (getattr(config, "shared_expert_intermediate_size", 0) or 0)


def names(key: str) -> Any:
    """TRL's ``--lora_target_modules q_proj v_proj`` as ``q_proj,v_proj``: a list of names (or ``all-linear``)."""

    def convert(value: Any) -> list[tuple[str, Any]]:
        return [(key, [part.strip() for part in str(value).replace(" ", ",").split(",") if part.strip()])]

    return convert
