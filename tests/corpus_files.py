"""Corpora for the tests and the corpus benchmark: documents cut from this Python's standard library
(real text, no download), written as JSON-lines and parquet shards; a word tokenizer with the
corpus path's interface; each step's blocks as the order says they are, computed without Ray."""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytpu.corpus.order import EpochOrder
from raytpu.corpus.packing import Packing, unit_blocks
from raytpu.corpus.sources import Unit


class WordEncoder:
    """A tokenizer of whitespace words (ids from the characters): the corpus path's interface."""

    eos_id = 0
    vocab_size = 1000
    fingerprint = "words"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[1 + sum(map(ord, word)) % 999 for word in text.split()] for text in texts]


def stdlib_documents(characters: int, start: int = 0) -> list[str]:
    """Documents of the standard library's sources (each function or class a document, in file
    name order), ``characters`` of text in all, from the ``start``-th document on."""
    found, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for part in path.read_text(errors="replace").split("\ndef "):
            if len(part) < 40:
                continue
            if start:
                start -= 1
                continue
            found.append(part)
            size += len(part)
            if size >= characters:
                return found
    return found


def write_shards(folder: Path, documents: list[str], jsonl: int, parquet: int) -> list[Path]:
    """``documents`` dealt round-robin into ``jsonl`` JSON-lines shards and ``parquet`` parquet ones."""
    folder.mkdir(parents=True, exist_ok=True)
    shards = jsonl + parquet
    paths = []
    for index in range(shards):
        part = documents[index::shards]
        if index < jsonl:
            path = folder / f"part-{index:03d}.jsonl"
            path.write_text("".join(json.dumps({"text": text, "shard": index}) + "\n" for text in part))
        else:
            path = folder / f"part-{index:03d}.parquet"
            pq.write_table(pa.table({"text": part, "shard": [index] * len(part)}), path)
        paths.append(path)
    return paths


def row_hash(row: np.ndarray) -> str:
    return hashlib.blake2b(np.asarray(row, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def expected_steps(units: list[Unit], order: EpochOrder, packing: Packing, epochs: int) -> list[Counter]:
    """Every step's blocks (as a multiset of row hashes), epoch after epoch, by the order's rule and
    the packer alone: what any run of that order must train."""
    steps = []
    for epoch in range(epochs):
        stream = np.concatenate([b for unit in order.unit_order(epoch) for b in unit_blocks(units[unit], packing)])
        for step in range(order.steps):
            first = step * order.global_batch
            window = first // order.window
            shuffled = stream[window * order.window :][: order.window_size(window)][order.permutation(epoch, window)]
            rows = shuffled[first - window * order.window :][: order.global_batch]
            steps.append(Counter(row_hash(row) for row in rows))
    return steps


def steps_seen(seen: Path) -> dict[int, Counter]:
    """Each step's blocks over every rank and micro-batch, as the last attempt that ran it trained
    them (an attempt's processes are the ones that began at the same step)."""
    records = [json.loads(line) for path in sorted(seen.glob("*.jsonl")) for line in path.read_text().splitlines()]
    began: dict[int, int] = {}
    for record in records:
        began[record["pid"]] = min(began.get(record["pid"], record["step"]), record["step"])
    by_step: dict[int, list[dict]] = {}
    for record in records:
        by_step.setdefault(record["step"], []).append(record)
    steps = {}
    for step, ran in by_step.items():
        last = max(began[record["pid"]] for record in ran)
        steps[step] = sum((Counter(r["rows"]) for r in ran if began[r["pid"]] == last), Counter())
    return steps
