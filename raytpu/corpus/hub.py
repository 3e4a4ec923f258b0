"""A data set by name, as ``datasets`` users name it (``data.dataset_name``: ``--dataset_name``): a
repository of the Hugging Face Hub (``org/name``) or a folder in a Hub repository's layout, with
``data.dataset_config_name`` and its splits, resolved to the files raytpu's corpus reads.

The driver fetches the repository's files into the Hugging Face cache of its machine
(``huggingface_hub.snapshot_download``: ``HF_HOME`` / ``HF_HUB_CACHE``, the machine's token,
``HF_HUB_OFFLINE=1`` reads the cache alone), and ``datasets`` says which files are which split of
which config (the repository's README ``configs``, else its file names), as ``load_dataset`` does.
A ``datasets`` ``save_to_disk`` folder is read as it is (:mod:`raytpu.corpus.sources`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from raytpu.errors import ConfigError

#: a save_to_disk folder's own files (read as Arrow streams by raytpu.corpus.sources)
SAVED = ("dataset_dict.json", "state.json")
#: the split names taken for validation when data.dataset_test_split names none
VALIDATION_SPLITS = ("validation", "valid", "val", "test")


def is_saved(location: str) -> bool:
    return any((Path(location) / name).is_file() for name in SAVED)


def with_dataset_files(data: Any) -> Any:
    """``data`` (the config's data settings) with ``data.dataset_name``'s files in ``train_files``
    and, unless given, ``validation_files`` (its test split, or one named validation / valid / val /
    test; none: a held-out share of the training documents)."""
    name = data.dataset_name
    if is_saved(name):  # a DatasetDict's validation split is found by the corpus reader
        return dataclasses.replace(data, train_files=[name])
    splits = dataset_splits(name, data.dataset_config_name)
    described = f"data.dataset_name={name!r}" + (
        f" (config {data.dataset_config_name!r})" if data.dataset_config_name else ""
    )
    train = data.dataset_train_split
    if train not in splits:
        raise ConfigError(
            f"{described} has no split {train!r} (it has {', '.join(splits)}); name one with data.dataset_train_split"
        )
    test = data.dataset_test_split or next((s for s in VALIDATION_SPLITS if s in splits and s != train), "")
    if data.dataset_test_split and test not in splits:
        raise ConfigError(
            f"{described} has no split {test!r} (it has {', '.join(splits)}); name one with data.dataset_test_split"
        )
    validation = data.validation_files or (splits[test] if test else [])
    return dataclasses.replace(data, train_files=splits[train], validation_files=validation)


def dataset_splits(name: str, config_name: str) -> dict[str, list[str]]:
    """Split -> its files on this machine, for a Hub repository or a folder in its layout."""
    from datasets import load_dataset_builder

    folder = name if Path(name).is_dir() else fetch(name)
    try:
        builder = load_dataset_builder(folder, config_name or None)
    except ValueError as exc:  # an unknown config: datasets lists the ones there are
        raise ConfigError(f"data.dataset_name={name!r}: {' '.join(str(exc).split())}") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"data.dataset_name={name!r} holds no data files datasets can read ({exc})") from None
    files = builder.config.data_files or {}
    if not files:
        raise ConfigError(f"data.dataset_name={name!r} holds no data files datasets can read")
    return {str(split): [str(path) for path in paths] for split, paths in files.items()}


def fetch(name: str) -> str:
    """The repository's files in this machine's Hugging Face cache (downloaded there once)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    key = f"data.dataset_name={name!r}"
    try:
        return snapshot_download(name, repo_type="dataset")
    except GatedRepoError:
        raise ConfigError(
            f"{key} is a gated data set: accept its terms on huggingface.co/datasets/{name}, then log in "
            "on this machine (`hf auth login`, or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{key} is neither a folder here nor a data set on the Hugging Face Hub (a private one needs a "
            "login: `hf auth login`, or HF_TOKEN); check the name"
        ) from None
    except HFValidationError:
        raise ConfigError(f"{key} is no folder here, nor a Hugging Face Hub name (org/name); check the path") from None
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE=1 is set" if constants.HF_HUB_OFFLINE else "the Hub does not answer"
        raise ConfigError(
            f"{key} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {offline}: download it once "
            f"where the Hub answers (`hf download {name} --repo-type dataset`), or give a local folder"
        ) from None
