"""Documents to fixed-shape token blocks: tokenized by the job's fast tokenizer, joined by its
end-of-text token and cut into blocks of the job's sequence length, as Transformers' ``run_clm.py``
groups texts.

Each unit (a file) is packed on its own: its documents' ids, each followed by EOS, are cut into
consecutive blocks and the unit's last partial block is dropped (at most ``length - 1`` tokens a
file). So a unit's blocks depend on that unit alone, whichever task packs it and wherever a
resumed run starts reading. A validation share is held out document by document
(:func:`held_out`): a hash of the unit's name and the document's place in it, the same on every
machine and for every seed.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from raytpu.corpus.sources import Unit, documents


@runtime_checkable
class TextEncoder(Protocol):
    """What a job's tokenizer gives the corpus path (picklable: it travels to every task)."""

    eos_id: int
    vocab_size: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, without special tokens."""
        ...


class TokenizerEncoder:
    """A Hugging Face fast tokenizer as the corpus path uses it: its ``tokenizers`` core travels as
    JSON (what ``tokenizer.json`` holds) and is rebuilt once per process. It lives here, not in a
    job, so that a tokenizing task imports ``tokenizers`` alone, never the job's model code."""

    def __init__(self, tokenizer_json: str, eos_id: int, vocab_size: int) -> None:
        self.json, self.eos_id, self.vocab_size = tokenizer_json, int(eos_id), int(vocab_size)
        self.fingerprint = hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerEncoder:
        """From a Transformers ``PreTrainedTokenizerFast``; one without an end-of-text token is refused."""
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-text token to join documents with; give it an eos_token")
        return cls(tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, len(tokenizer))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = backend(self.json, self.fingerprint).encode_batch(texts, add_special_tokens=False)
        return [encoding.ids for encoding in encodings]


#: tokenizers rebuilt in this process, by fingerprint
BACKENDS: dict[str, Any] = {}


def backend(text: str, fingerprint: str) -> Any:  # a tokenizers.Tokenizer
    if fingerprint not in BACKENDS:
        from tokenizers import Tokenizer

        BACKENDS[fingerprint] = Tokenizer.from_str(text)
    return BACKENDS[fingerprint]


@dataclass(frozen=True)
class Packing:
    """How documents become blocks: ``length`` tokens a block, the text in ``text_column``, and
    ``holdout`` percent of the documents kept for validation (0: none); ``keep`` the side packed
    (``train``: the rest; ``valid``: the held-out documents; ``all``: every document)."""

    encoder: TextEncoder
    length: int
    text_column: str = "text"
    holdout: float = 0.0
    keep: str = "all"

    @property
    def dtype(self) -> np.dtype:
        """The smallest dtype that holds every id (uint16 up to 65,536 entries)."""
        return np.dtype(np.uint16 if self.encoder.vocab_size <= 1 << 16 else np.int32)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """The shape of one block."""
        return (self.length,)

    def kept(self, unit: Unit, index: int) -> bool:
        return kept(unit, index, self.holdout, self.keep)

    def blocks(self, unit: Unit, skip: int = 0) -> Iterator[np.ndarray]:
        return unit_blocks(unit, self, skip)

    def count(self, unit: Unit) -> UnitCount:
        return count_unit(unit, self)


def kept(unit: Unit, index: int, holdout: float, keep: str) -> bool:
    """Whether document ``index`` of ``unit`` is on the side ``keep`` of a ``holdout`` percent share."""
    if keep == "all" or not holdout:
        return keep != "valid"
    return held_out(unit.name, index, holdout) == (keep == "valid")


def held_out(name: str, index: int, percent: float) -> bool:
    """Whether document ``index`` of the unit named ``name`` is in the held-out ``percent``."""
    digest = hashlib.blake2b(f"{name}\0{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 1_000_000 < percent * 10_000


def unit_ids(unit: Unit, packing: Packing) -> Iterator[tuple[np.ndarray, int]]:
    """The token ids of the unit's kept documents, each followed by EOS, a tokenizer batch at a
    time, with the number of documents in it."""
    index = 0
    for texts in documents(unit, packing.text_column):
        chosen = [text for offset, text in enumerate(texts) if packing.kept(unit, index + offset)]
        index += len(texts)
        if not chosen:
            continue
        encoded = packing.encoder.encode_batch(chosen)
        lengths = np.fromiter((len(ids) for ids in encoded), dtype=np.int64, count=len(encoded))
        flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=packing.dtype, count=int(lengths.sum()))
        yield np.insert(flat, np.cumsum(lengths), packing.encoder.eos_id), len(chosen)


def unit_blocks(unit: Unit, packing: Packing, skip: int = 0) -> Iterator[np.ndarray]:
    """The unit's blocks, ``(n, length)`` arrays in order, less the first ``skip`` (a resumed
    run's position inside the unit: tokenized again, not handed on)."""
    length = packing.length
    carry = np.empty(0, dtype=packing.dtype)
    for ids, _ in unit_ids(unit, packing):
        tokens = np.concatenate([carry, ids]) if len(carry) else ids
        whole = len(tokens) // length
        carry = tokens[whole * length :]
        if whole == 0:
            continue
        blocks = tokens[: whole * length].reshape(whole, length)
        if skip >= whole:
            skip -= whole
            continue
        yield blocks[skip:]
        skip = 0


@dataclass(frozen=True)
class UnitCount:
    """What packing one unit gave: its documents (kept ones), tokens and whole blocks, and the
    documents cut to fit a block (rows: ``raytpu.corpus.rows``; text is cut into blocks anyway)."""

    documents: int
    tokens: int
    blocks: int
    cut: int = 0


def count_unit(unit: Unit, packing: Packing) -> UnitCount:
    """Pack the unit and count (the corpus index: ``raytpu.corpus.index``)."""
    documents_kept = tokens = 0
    for ids, count in unit_ids(unit, packing):
        documents_kept += count
        tokens += len(ids)
    return UnitCount(documents_kept, tokens, tokens // packing.length)
