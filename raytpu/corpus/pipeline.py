"""The corpus path's Ray Data pipelines: a unit a task, tokenized and packed in parallel (text
blocks, ``raytpu.corpus.packing``, or rows of fields, ``raytpu.corpus.rows``: any packing with
``blocks``, ``count`` and ``row_shape``), the
blocks streamed in the units' order whatever order the tasks finish in (``preserve_order``), the
object store bounded by Ray Data's back-pressure.

Each pipeline starts from the units themselves (``ray.data.from_items``, one row and one task a
unit) and reads them inside the task, so that a unit's blocks never depend on how files were
grouped into read tasks, and a resumed run can start at any unit (``raytpu.corpus.order``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from raytpu.corpus.packing import Packing, UnitCount
from raytpu.corpus.sources import CorpusError, Unit

FIELDS = tuple(field.name for field in dataclasses.fields(Unit))


def rows_of(units: Sequence[Unit], skip: int = 0, first_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
    """One row per unit: its fields, the blocks to skip (the first unit's only) and the id of its
    first block (eval sets number their blocks; else 0)."""
    return [
        {
            **dataclasses.asdict(unit),
            "skip": skip if index == 0 else 0,
            "first_id": first_ids[index] if first_ids else 0,
        }
        for index, unit in enumerate(units)
    ]


def unit_in(batch: dict[str, Any], index: int) -> Unit:
    """Row ``index`` of a numpy batch of :func:`rows_of` rows, as its unit."""
    row = {name: batch[name][index] for name in FIELDS}
    texts = {name: str(row[name]) for name in ("root", "path", "format", "name")}
    return Unit(**texts, size=int(row["size"]), mtime_ns=int(row["mtime_ns"]))


def block_table(ids: np.ndarray, blocks: np.ndarray) -> pa.Table:
    """Blocks as an arrow table: ``id`` and ``input_ids`` (a fixed-size list per block, of all its
    values: a row of fields' channels one after the other)."""
    flat = pa.array(blocks.reshape(-1))
    size = int(np.prod(blocks.shape[1:]))
    return pa.table({"id": pa.array(ids), "input_ids": pa.FixedSizeListArray.from_arrays(flat, size)})


def blocks_of(table: pa.Table, shape: tuple[int, ...]) -> np.ndarray:
    """The ``(n, *shape)`` blocks of a :func:`block_table` table."""
    column = table.column("input_ids").combine_chunks()
    return column.flatten().to_numpy(zero_copy_only=False).reshape(-1, *shape)


def pack_rows(batch: dict[str, Any], packing: Packing) -> Iterator[pa.Table]:
    """Ray Data's map function: the blocks of each unit row, as they are packed."""
    for index in range(len(batch["path"])):
        unit, skip, first = unit_in(batch, index), int(batch["skip"][index]), int(batch["first_id"][index])
        for blocks in packing.blocks(unit, skip):
            yield block_table(np.arange(first, first + len(blocks), dtype=np.int64), blocks)
            first += len(blocks)


COUNTS = tuple(field.name for field in dataclasses.fields(UnitCount))


def count_rows(batch: dict[str, Any], packing: Packing) -> dict[str, np.ndarray]:
    """Ray Data's map function of the index: each unit's counts, or why it cannot be read (a
    :class:`CorpusError`'s message, handed back as data: Ray Data's error would wrap it in a traceback)."""
    counts, errors = [], []
    for index in range(len(batch["path"])):
        try:
            counts.append(packing.count(unit_in(batch, index)))
            errors.append("")
        except CorpusError as exc:
            counts.append(UnitCount(0, 0, 0))
            errors.append(str(exc))
    columns = {name: np.array([getattr(count, name) for count in counts]) for name in COUNTS}
    return {"error": np.array(errors), **columns}


def quiet_ray_data() -> None:
    """Ray Data's per-dataset lines (progress bars off, execution started and finished, a
    deprecation Ray Train itself triggers) kept off the run's console; warnings of substance stay."""
    import logging
    import warnings

    logging.getLogger("ray.data").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*exclude_resources.*")


def dataset_of(rows: list[dict[str, Any]], function: Any, packing: Packing) -> Any:
    """A Ray Dataset of one task a row, in the rows' order."""
    import ray.data

    quiet_ray_data()
    dataset = ray.data.from_items(rows, override_num_blocks=max(len(rows), 1))
    dataset = dataset.map_batches(function, fn_kwargs={"packing": packing}, batch_size=1, batch_format="numpy")
    dataset.context.execution_options.preserve_order = True
    dataset.context.enable_progress_bars = False
    return dataset


def count_units(units: Sequence[Unit], packing: Packing) -> list[UnitCount]:
    """Every unit packed in parallel tasks and counted (the index pass); nothing but counts
    reaches the driver."""
    if not units:
        return []
    counted = dataset_of(rows_of(units), count_rows, packing).take_all()
    error = next((str(row["error"]) for row in counted if row["error"]), "")
    if error:
        raise CorpusError(error)
    return [UnitCount(**{name: int(row[name]) for name in COUNTS}) for row in counted]


def block_stream(units: Sequence[Unit], packing: Packing, skip: int = 0) -> Iterator[np.ndarray]:
    """The blocks of ``units``, in order (less ``skip`` of the first), as ``(n, *row_shape)`` arrays."""
    if not units:
        return
    dataset = dataset_of(rows_of(units, skip), pack_rows, packing)
    for table in dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
        yield blocks_of(table, packing.row_shape)


def numbered_blocks(units: Sequence[Unit], counts: Sequence[int], packing: Packing, limit: int = 0) -> Any:
    """An eval set: the blocks of ``units`` numbered in order (``id``), at most ``limit`` (0: all),
    read into the object store once."""
    first_ids = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist() if counts else []
    kept = [
        (unit, first) for unit, first, count in zip(units, first_ids, counts) if count and (not limit or first < limit)
    ]
    dataset = dataset_of(rows_of([u for u, _ in kept], 0, [f for _, f in kept]), pack_rows, packing)
    if limit:
        dataset = dataset.limit(limit)
    return dataset.materialize()
