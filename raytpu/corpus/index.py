"""A user's corpus made ready on the driver: its files found, the job's tokenizer, and the index.

The index (``<data.path>/corpus_index.json``) lists the training and validation units and how
many blocks each gives at the run's sequence length: an epoch's length, and where every step's
blocks are read from (``raytpu.corpus.order``), without holding a token. It is made by one
parallel pass of Ray Data tasks (``raytpu.corpus.pipeline.count_units``) and made again only
when a file, the tokenizer or a packing option changed (its fingerprint).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytpu.config import Config
from raytpu.corpus.packing import Packing, TextEncoder, UnitCount
from raytpu.corpus.rows import RowEncoder, RowPacking
from raytpu.corpus.sources import CorpusError, Unit, documents, find_units, fingerprint, validation_split_of
from raytpu.errors import ConfigError

INDEX_FILE = "corpus_index.json"
#: the index's layout; another is made again
FORMAT = "raytpu-corpus/1"


@dataclass(frozen=True)
class Sources:
    """The files a run trains and validates on, and the share of training documents held out
    for validation when no validation files are named (0 when they are)."""

    train: tuple[Unit, ...]
    valid: tuple[Unit, ...]
    holdout: float

    def packings(self, encoder: TextEncoder | RowEncoder, length: int, column: str) -> tuple[Any, Any]:
        """How the training and the validation units are packed: text into blocks, or rows of fields
        by the job's :class:`~raytpu.corpus.rows.RowEncoder`."""
        if isinstance(encoder, RowEncoder):
            if self.holdout:
                return (RowPacking(encoder, length, self.holdout, "train"),
                        RowPacking(encoder, length, self.holdout, "valid"))  # fmt: skip
            return RowPacking(encoder, length), RowPacking(encoder, length)
        if self.holdout:
            return (Packing(encoder, length, column, self.holdout, "train"),
                    Packing(encoder, length, column, self.holdout, "valid"))  # fmt: skip
        return Packing(encoder, length, column), Packing(encoder, length, column)


def find_sources(cfg: Config, job: Any = None) -> Sources:
    """``data.train_files`` and ``data.validation_files`` (or ``data.dataset_name``'s splits, or a
    ``DatasetDict``'s validation split,
    or ``data.validation_split_percentage`` of the training documents); with no training files,
    the job's own text (``ReadsText.default_text``)."""
    data = cfg.data
    if data.dataset_name:
        from raytpu.corpus.hub import with_dataset_files

        data = with_dataset_files(data)
    if not data.train_files and job is not None:
        train_files, validation_files = job.default_text(cfg)
        data = dataclasses.replace(data, train_files=train_files, validation_files=validation_files)
    train = find_units(data.train_files, "data.train_files")
    if data.validation_files:
        return Sources(tuple(train), tuple(find_units(data.validation_files, "data.validation_files")), 0.0)
    split = validation_split_of(data.train_files[0]) if len(data.train_files) == 1 else None
    if split:
        return Sources(tuple(train), tuple(split), 0.0)
    if not 0 < data.validation_split_percentage < 100:
        raise ConfigError(
            "no validation text: name data.validation_files (--validation_file), or hold out a share of the "
            f"training documents with data.validation_split_percentage between 0 and 100 (got "
            f"{data.validation_split_percentage:g})"
        )
    return Sources(tuple(train), tuple(train), float(data.validation_split_percentage))


def sample_texts(units: tuple[Unit, ...], column: str) -> Callable[[], Iterator[str]]:
    """The training documents in order, for a tokenizer trained on them (the job reads what it needs)."""

    def texts() -> Iterator[str]:
        for unit in units:
            for batch in documents(unit, column):
                yield from batch

    return texts


@dataclass(frozen=True)
class CorpusIndex:
    fingerprint: str
    sources: Sources
    train_counts: tuple[UnitCount, ...]
    valid_counts: tuple[UnitCount, ...]

    @property
    def train_blocks(self) -> int:
        return sum(count.blocks for count in self.train_counts)

    @property
    def valid_blocks(self) -> int:
        return sum(count.blocks for count in self.valid_counts)

    def record(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "holdout": self.sources.holdout,
            "train": [{**asdict(unit), **asdict(count)} for unit, count in zip(self.sources.train, self.train_counts)],
            "valid": [{**asdict(unit), **asdict(count)} for unit, count in zip(self.sources.valid, self.valid_counts)],
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> CorpusIndex:
        def split(rows: list[dict[str, Any]]) -> tuple[tuple[Unit, ...], tuple[UnitCount, ...]]:
            units = tuple(Unit(**{k: row[k] for k in Unit.__dataclass_fields__}) for row in rows)
            counts = tuple(UnitCount(**{k: row.get(k, 0) for k in UnitCount.__dataclass_fields__}) for row in rows)
            return units, counts

        train, train_counts = split(record["train"])
        valid, valid_counts = split(record["valid"])
        sources = Sources(train, valid, float(record["holdout"]))
        return cls(record["fingerprint"], sources, train_counts, valid_counts)


def index_fingerprint(sources: Sources, encoder: TextEncoder | RowEncoder, length: int, column: str) -> str:
    identity = getattr(encoder, "fingerprint", type(encoder).__name__)
    units = (*sources.train, *sources.valid)
    return fingerprint(units, FORMAT, len(sources.train), sources.holdout, identity, length, column)


def read_index(root: Path) -> CorpusIndex | None:
    path = Path(root) / INDEX_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return CorpusIndex.from_record(record) if record.get("format") == FORMAT else None


def corpus_index(
    root: Path, sources: Sources, encoder: TextEncoder | RowEncoder, length: int, column: str
) -> CorpusIndex:
    """The index of ``sources`` packed at ``length``: the one in ``root`` when it is of the same
    files and options, else counted by Ray Data tasks and written there."""
    from raytpu.corpus.pipeline import count_units

    key = index_fingerprint(sources, encoder, length, column)
    found = read_index(root)
    if found is not None and found.fingerprint == key:
        return found
    train_packing, valid_packing = sources.packings(encoder, length, column)
    try:
        index = CorpusIndex(
            key,
            sources,
            tuple(count_units(sources.train, train_packing)),
            tuple(count_units(sources.valid, valid_packing)),
        )
    except Exception as exc:
        raise corpus_error(exc) from None
    Path(root).mkdir(parents=True, exist_ok=True)
    staged = Path(root) / f".{INDEX_FILE}.{os.getpid()}"
    staged.write_text(json.dumps(index.record(), indent=1))
    os.replace(staged, Path(root) / INDEX_FILE)
    return index


def corpus_error(exc: BaseException) -> BaseException:
    """A :class:`CorpusError` raised in a Ray task, as itself (Ray wraps it); anything else as it is."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, CorpusError):
            return CorpusError(str(cause).strip().splitlines()[-1])
        cause = getattr(cause, "cause", None) or cause.__cause__
    return exc
