"""A tokenized corpus in one folder, for the torch path (``data.loader: torch``): small corpora
on a local disk, tokenized once on the driver and memory-mapped by every worker.

Layout (the causal LM's made-up corpus has it too)::

    <root>/train.npy, valid.npy, test.npy   each split's token ids, every document followed by EOS
    <root>/corpus.json                      the source, the vocabulary, each split's tokens, the fingerprint

``test`` is the validation text (a corpus of one's own names no test split). The files are written
from the tokenizer's output a batch at a time, never a Python list of every id.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from raytpu.corpus.index import Sources, index_fingerprint
from raytpu.corpus.packing import Packing, TextEncoder, unit_ids
from raytpu.corpus.sources import Unit

SPLITS = ("train", "valid", "test")
SUMMARY = "corpus.json"


def token_path(root: Path, split: str) -> Path:
    return Path(root) / f"{split}.npy"


def read_split(root: Path, split: str) -> np.ndarray:
    path = token_path(root, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; make the data again (raytpu train makes it from data.train_files)")
    return np.load(path, mmap_mode="r")


def read_summary(root: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(root) / SUMMARY).read_text())
    except (OSError, ValueError):
        return None


def write_summary(root: Path, summary: dict[str, Any]) -> None:
    staged = Path(root) / f".{SUMMARY}.{os.getpid()}"
    staged.write_text(json.dumps(summary, indent=1))
    os.replace(staged, Path(root) / SUMMARY)


def write_split(root: Path, split: str, arrays: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Write ``arrays`` one after the other as ``<split>.npy``; the tokens written."""
    with tempfile.TemporaryFile(dir=root) as raw:
        count = 0
        for array in arrays:
            raw.write(np.ascontiguousarray(array, dtype=dtype).tobytes())
            count += len(array)
        raw.seek(0)
        staged = Path(root) / f".{split}.{os.getpid()}.npy"
        out = np.lib.format.open_memmap(staged, mode="w+", dtype=dtype, shape=(count,))
        if count:
            out[:] = np.frombuffer(raw.read(), dtype=dtype)
        out.flush()
        del out
    os.replace(staged, token_path(root, split))
    return count


def split_ids(units: Iterable[Unit], packing: Packing) -> Iterable[np.ndarray]:
    for unit in units:
        for ids, _ in unit_ids(unit, packing):
            yield ids


def tokenize_corpus(root: Path, sources: Sources, encoder: TextEncoder, column: str) -> dict[str, Any]:
    """The corpus's splits tokenized into ``root`` (left as they are when made from the same files
    and tokenizer); the summary."""
    key = index_fingerprint(sources, encoder, 0, column)
    summary = read_summary(root)
    if summary is not None and summary.get("fingerprint") == key and all(token_path(root, s).is_file() for s in SPLITS):
        return summary
    Path(root).mkdir(parents=True, exist_ok=True)
    train, valid = sources.packings(encoder, 1, column)
    counts = {
        "train": write_split(root, "train", split_ids(sources.train, train), train.dtype),
        "valid": write_split(root, "valid", split_ids(sources.valid, valid), valid.dtype),
    }
    counts["test"] = write_split(root, "test", [read_split(root, "valid")], valid.dtype)
    summary = {
        "source": "data.train_files",
        "fingerprint": key,
        "vocab_size": encoder.vocab_size,
        "splits": {split: {"tokens": tokens} for split, tokens in counts.items()},
    }
    write_summary(root, summary)
    return summary
