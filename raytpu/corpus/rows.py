"""Rows of fields (conversations, prompts and completions: TRL's formats) streamed by Ray Data:
the streamed form of a fine-tuning job's rows (:class:`~raytpu.job.TakesRecords`), read, tokenized
and packed in the corpus path's tasks like text (``raytpu.corpus.pipeline``), in the order of
``raytpu.corpus.order`` and through the feeder, so that a resumed or resized run trains the rows
an uninterrupted one would have.

The job's :class:`RowEncoder` turns a group of rows into fixed-shape rows of three channels (ids,
labels with -100 where no loss is taken, and each token's document, -1 for padding): through its
chat template, with its loss masks, packed best-fit or one example a row. Each unit's rows go to it
:data:`GROUP_ROWS` at a time, in file order, so a unit's packed rows depend on that unit alone,
whichever task packs it and wherever a resumed run starts reading; a validation share is held out
row by row as text documents are (:func:`~raytpu.corpus.packing.held_out`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from raytpu.corpus.packing import UnitCount, kept
from raytpu.corpus.sources import CorpusError, Unit, documents, records

#: the channels of a packed row: ids, labels (-100: no loss), the document of each token (-1: padding)
CHANNELS = 3
#: rows of a unit packed together (best-fit packing chooses within them)
GROUP_ROWS = 1024


@dataclass(frozen=True)
class EncodedRows:
    """A group of rows made ready: ``rows`` ``(n, CHANNELS, length)`` int32, and what went in: the
    examples, those cut to fit a row, and the tokens kept."""

    rows: np.ndarray
    examples: int
    cut: int
    tokens: int


@runtime_checkable
class RowEncoder(Protocol):
    """What a fine-tuning job gives the streamed path (picklable: it travels to every task)."""

    fingerprint: str
    vocab_size: int
    text_column: str

    def encode_rows(self, rows: list[dict[str, Any]], where: list[str], length: int) -> EncodedRows:
        """``rows`` (``where`` names each for an error) as packed rows of ``length`` tokens; a row
        that cannot be trained on raises ``ValueError`` saying which and why."""
        ...


@dataclass(frozen=True)
class RowPacking:
    """How a unit's rows become packed rows: ``length`` tokens a row, and ``holdout`` percent of the
    rows kept for validation (``keep``: ``train``, ``valid`` or ``all``, as :class:`~raytpu.corpus.
    packing.Packing`)."""

    encoder: RowEncoder
    length: int
    holdout: float = 0.0
    keep: str = "all"

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (CHANNELS, self.length)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int32)

    def groups(self, unit: Unit) -> Iterator[EncodedRows]:
        """The unit's kept rows, :data:`GROUP_ROWS` at a time, encoded; a bad row is one
        :class:`CorpusError` naming it."""
        chosen: list[dict[str, Any]] = []
        where: list[str] = []
        for index, row in enumerate(unit_rows(unit, self.encoder.text_column)):
            if kept(unit, index, self.holdout, self.keep):
                chosen.append(row)
                where.append(f"{unit.name} row {index + 1}")
            if len(chosen) == GROUP_ROWS:
                yield self._encode(chosen, where)
                chosen, where = [], []
        if chosen:
            yield self._encode(chosen, where)

    def _encode(self, rows: list[dict[str, Any]], where: list[str]) -> EncodedRows:
        try:
            return self.encoder.encode_rows(rows, where, self.length)
        except ValueError as exc:
            raise CorpusError(str(exc)) from None

    def blocks(self, unit: Unit, skip: int = 0) -> Iterator[np.ndarray]:
        """The unit's packed rows in order, less the first ``skip`` (encoded again, not handed on)."""
        for group in self.groups(unit):
            if skip >= len(group.rows):
                skip -= len(group.rows)
                continue
            yield group.rows[skip:]
            skip = 0

    def count(self, unit: Unit) -> UnitCount:
        """Pack the unit and count (the corpus index): its examples, tokens, packed rows and cut examples."""
        total = np.zeros(4, np.int64)
        for group in self.groups(unit):
            total += (group.examples, group.tokens, len(group.rows), group.cut)
        return UnitCount(*(int(value) for value in total))


def unit_rows(unit: Unit, text_column: str) -> Iterator[dict[str, Any]]:
    """The unit's rows as mappings of their fields; a text file's one document as a row of text."""
    if unit.format == "text":
        for batch in documents(unit, text_column):
            yield from ({text_column: text} for text in batch)
        return
    for batch in records(unit):
        yield from batch


def fixed_rows(packed: list[tuple[list[int], list[int], list[int]]], length: int, pad_id: int) -> np.ndarray:
    """Rows of (ids, labels, document lengths) as ``(n, CHANNELS, length)``: padded with ``pad_id``,
    -100 and document -1."""
    out = np.empty((len(packed), CHANNELS, length), np.int32)
    out[:, 0], out[:, 1], out[:, 2] = pad_id, -100, -1
    for index, (ids, labels, lengths) in enumerate(packed):
        out[index, 0, : len(ids)] = ids
        out[index, 1, : len(labels)] = labels
        out[index, 2, : sum(lengths)] = np.repeat(np.arange(len(lengths)), lengths)
    return out


def positions(segments: np.ndarray) -> np.ndarray:
    """Each token's position in its own document (padding: 0), from ``(n, length)`` documents."""
    places = np.broadcast_to(np.arange(segments.shape[1]), segments.shape)
    starts = np.ones_like(segments, dtype=bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = np.maximum.accumulate(np.where(starts, places, 0), axis=1)
    return np.where(segments >= 0, places - first, 0)


def rows_batch(rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Packed rows ``(n, CHANNELS, length)`` as the batch a fine-tuning job trains on: ``input_ids``,
    ``labels``, ``position_ids`` (counted from 0 in each document) and ``segments`` (-1: padding)."""
    ids, labels, segments = (rows[:, channel].astype(np.int64) for channel in range(CHANNELS))
    return {
        "input_ids": torch.from_numpy(ids),
        "labels": torch.from_numpy(labels),
        "position_ids": torch.from_numpy(positions(segments)),
        "segments": torch.from_numpy(segments),
    }
