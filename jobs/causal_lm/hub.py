"""Models, configs and tokenizers by Hugging Face Hub name or local folder, loaded by Transformers.

A name such as ``Qwen/Qwen2.5-0.5B`` goes to Transformers' ``from_pretrained`` as the user typed it,
with ``job.revision``, ``job.cache_dir`` and ``job.trust_remote_code`` (passed only when set): the
files land in the Hugging Face cache of the machine that asks (``HF_HOME`` / ``HF_HUB_CACHE``, or
``job.cache_dir``), read with the machine's token (``HF_TOKEN`` or ``hf auth login``), and with
``HF_HUB_OFFLINE=1`` from that cache alone.

Who downloads: the driver reads the config (and the tokenizer) before any worker starts, so that a
name that does not exist, is gated, or is missing from the cache offline is one line at once; each
worker builds the model with ``from_pretrained`` (under FSDP2, reads its shards of the weights from
the files :func:`weight_files` fetches), and huggingface_hub locks each file of the cache while one
process downloads it: on a machine, the weights are fetched once, whatever the number of workers
there; a cluster of several nodes fetches them once per node.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def is_local(name: str) -> bool:
    """A folder on this machine (else a name the Hub resolves, ``org/name``)."""
    return Path(name).expanduser().is_dir()


def options(job: Any) -> dict[str, Any]:
    """What ``from_pretrained`` is given besides the name: the revision, the cache and remote code,
    each only where the config sets it (Transformers' own defaults otherwise)."""
    given: dict[str, Any] = {}
    if job.revision and job.revision != "main":
        given["revision"] = job.revision
    if job.cache_dir:
        given["cache_dir"] = job.cache_dir
    if job.trust_remote_code:
        given["trust_remote_code"] = True
    return given


def cache_location(given: dict[str, Any]) -> str:
    from huggingface_hub import constants

    return given.get("cache_dir") or constants.HF_HUB_CACHE


@contextlib.contextmanager
def hub_errors(key: str, name: str, given: dict[str, Any]) -> Iterator[None]:
    """Transformers' and huggingface_hub's errors about ``name`` (given as ``key``) as one line that
    says what to do; anything else as it is."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except HFValidationError:
        raise ValueError(not_a_name(key, name)) from None
    except GatedRepoError:
        raise ValueError(
            f"{key}={name!r} is a gated repository: accept its terms on huggingface.co/{name}, then log in on "
            "this machine (`hf auth login`, or HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        revision = given.get("revision", "main")
        raise ValueError(f"{key}={name!r} has no revision {revision!r}; give a branch, tag or commit of it") from None
    except RepositoryNotFoundError:
        raise ValueError(not_found(key, name)) from None
    except OSError as exc:
        text = str(exc)
        if "Repo id must" in text:  # Transformers' wrapping of huggingface_hub's validation
            raise ValueError(not_a_name(key, name)) from None
        if "is not a local folder and is not a valid model identifier" in text or "Repository Not Found" in text:
            raise ValueError(not_found(key, name)) from None
        if "couldn't connect" in text or "cached files" in text or "offline" in text.lower():
            offline = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub does not answer"
            raise ValueError(
                f"{key}={name!r} is not in the Hugging Face cache ({cache_location(given)}) and {offline}: "
                f"download it once where the Hub answers (`hf download {name}`, into the same cache), "
                "or give a local folder"
            ) from None
        raise


def not_a_name(key: str, name: str) -> str:
    return f"{key}={name!r} is no folder here, nor a Hugging Face Hub name (org/name); check the path"


def not_found(key: str, name: str) -> str:
    return (
        f"{key}={name!r} is neither a folder here nor a repository on the Hugging Face Hub (a private one "
        "needs a login: `hf auth login`, or HF_TOKEN); check the name"
    )


def load_config(name: str, given: dict[str, Any], key: str = "job.model_name_or_path") -> Any:
    """A ``PretrainedConfig``; ``given``: :func:`options`."""
    from transformers import AutoConfig

    with hub_errors(key, name, given):
        return AutoConfig.from_pretrained(name, **given)


def load_model(name: str, given: dict[str, Any], **kwargs: Any) -> Any:
    """A ``PreTrainedModel`` for causal LM; ``kwargs``: ``from_pretrained``'s (dtype, attention)."""
    from transformers import AutoModelForCausalLM

    with hub_errors("job.model_name_or_path", name, given):
        return AutoModelForCausalLM.from_pretrained(name, **given, **kwargs)


def weight_files(name: str, given: dict[str, Any]) -> list[Path]:
    """The safetensors files ``from_pretrained`` would read the weights from (``model.safetensors``,
    or the shards its index names), fetched into this machine's cache where missing; ``[]`` where
    there are none to be had (``.bin`` weights, or the Hub out of reach): rank 0 then loads the model
    through ``from_pretrained``, which says what is wrong."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError
    from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

    def fetched(filename: str) -> Path | None:
        if is_local(name):
            path = Path(name).expanduser() / filename
            return path if path.is_file() else None
        try:
            where = {key: value for key, value in given.items() if key in ("revision", "cache_dir")}
            return Path(hf_hub_download(name, filename, **where))
        except (HfHubHTTPError, OSError, ValueError):  # not in the repository, nor in the cache offline
            return None

    index = fetched(SAFE_WEIGHTS_INDEX_NAME)
    if index is None:
        single = fetched(SAFE_WEIGHTS_NAME)
        return [single] if single else []
    shards = [fetched(shard) for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [shard for shard in shards if shard] if all(shards) else []  # (the filter: for the type checker)


def load_tokenizer(name: str, given: dict[str, Any], key: str = "job.tokenizer") -> Any:
    """A ``PreTrainedTokenizerBase`` of a folder or a Hub name."""
    from transformers import AutoTokenizer

    with hub_errors(key, name, given):
        return AutoTokenizer.from_pretrained(name, **given)
