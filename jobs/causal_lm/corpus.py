"""A text corpus every machine has, a byte-level BPE tokenizer trained on it, and packed blocks.

The default corpus is a pinned list of the Python standard library's own source files, read
from this interpreter's ``stdlib`` folder: nothing is downloaded and, for one Python version,
the figures reproduce (docs/causal-lm.md's are for CPython 3.11). Any folder of text files can be used
instead (``--corpus DIR``). Documents are split by file, so the held-out text is code the model
never saw, and joined with the end-of-text token.

The data folder holds what Transformers users expect beside a model::

    <out>/tokenizer.json, tokenizer_config.json   AutoTokenizer.from_pretrained(<out>) loads it
    <out>/train.npy, valid.npy, test.npy           token ids of each split, documents joined by EOS
    <out>/corpus.json                              the files of each split, their sha256, token counts
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from raytpu.jobs.causal_lm import hub

EOS = "<|endoftext|>"
SPLITS = ("train", "valid", "test")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CORPUS_FILE = "corpus.json"

#: stdlib modules present, as single files, from CPython 3.10 to 3.13 (2.8 MB of text)
STDLIB_FILES: dict[str, tuple[str, ...]] = {
    "train": (
        "argparse.py", "ast.py", "base64.py", "bdb.py", "calendar.py", "codecs.py", "configparser.py",
        "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "dis.py",
        "doctest.py", "enum.py", "fractions.py", "ftplib.py", "functools.py", "gettext.py", "gzip.py",
        "heapq.py", "imaplib.py", "inspect.py", "ipaddress.py", "locale.py", "mailbox.py", "ntpath.py",
        "operator.py", "optparse.py", "os.py", "pdb.py", "pickle.py", "pickletools.py", "platform.py",
        "plistlib.py", "posixpath.py", "pprint.py", "pstats.py", "queue.py", "random.py", "selectors.py",
        "shlex.py", "shutil.py", "smtplib.py", "socket.py", "socketserver.py", "ssl.py", "statistics.py",
        "string.py", "subprocess.py", "tarfile.py", "tempfile.py", "textwrap.py", "threading.py",
    ),
    "valid": ("tokenize.py", "traceback.py", "typing.py"),
    "test": ("uuid.py", "weakref.py", "trace.py"),
}  # fmt: skip


def stdlib_files() -> dict[str, list[Path]]:
    """The pinned files of each split in this interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = {split: [root / name for name in names] for split, names in STDLIB_FILES.items()}
    missing = [str(path) for paths in files.values() for path in paths if not path.is_file()]
    if missing:
        raise FileNotFoundError(
            f"this Python's standard library lacks {', '.join(missing[:3])}; pass --corpus DIR (a folder of text files)"
        )
    return files


def folder_files(corpus: Path, valid_every: int = 20) -> dict[str, list[Path]]:
    """``--corpus DIR``: its ``*.py``, ``*.txt`` and ``*.md`` files in name order; every
    ``valid_every``-th file is held out for ``valid`` and the one after it for ``test``."""
    paths = sorted(p for p in Path(corpus).rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
    if len(paths) < 3:
        raise ValueError(f"--corpus {corpus} holds {len(paths)} .py/.txt/.md files; it needs at least 3")
    splits: dict[str, list[Path]] = {split: [] for split in SPLITS}
    for index, path in enumerate(paths):
        phase = index % valid_every
        splits["valid" if phase == valid_every - 2 else "test" if phase == valid_every - 1 else "train"].append(path)
    for split in ("valid", "test"):
        if not splits[split]:
            splits[split].append(splits["train"].pop())
    return splits


def train_tokenizer(texts: Sequence[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    """A byte-level BPE tokenizer (GPT-2's scheme, any byte representable) trained on ``texts``,
    wrapped for Transformers with ``<|endoftext|>`` as its BOS, EOS and padding token."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def load_tokenizer(folder: Path):  # -> PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    if not (Path(folder) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json; make the data with `raytpu data synth causal_lm`")
    return AutoTokenizer.from_pretrained(str(folder))


def tokenizer_source(tokenizer: str, model: str, data_root: Path) -> str:
    """Where a run's tokenizer comes from: ``job.tokenizer`` (a folder or a Hub name), else the
    pretrained model's own (its folder when it holds one, or its Hub name), else the data folder
    (the one trained on the corpus)."""
    if tokenizer:
        return tokenizer
    if model and (not hub.is_local(model) or (Path(model) / "tokenizer.json").is_file()):
        return model
    return str(data_root)


def run_tokenizer(source: str, data_root: Path, given: dict[str, Any]):  # -> PreTrainedTokenizerBase
    """The tokenizer of :func:`tokenizer_source`: the data folder's, or the one the user named
    (loaded by Transformers, from a folder or the Hub, with ``given``: :func:`hub.options`)."""
    if Path(source) == Path(data_root):
        return load_tokenizer(data_root)
    return hub.load_tokenizer(source, given)


#: characters of the training text a tokenizer is trained on when none is given
TRAINING_CHARACTERS = 64 << 20
#: the record, beside a tokenizer trained here, of the corpus it was trained on
TRAINED_ON = "tokenizer_source.json"


def corpus_tokenizer(
    tokenizer: str,
    data_root: Path,
    texts: Callable[[], Iterator[str]],
    source: str,
    vocab_size: int,
    given: dict[str, Any],
):
    """The tokenizer of a corpus of the user's: the one ``tokenizer`` names when it is not the data
    folder (:func:`run_tokenizer`); else the one trained there on this corpus before, or one trained
    now on its first :data:`TRAINING_CHARACTERS` characters and saved there."""
    if Path(tokenizer) != Path(data_root):
        return run_tokenizer(tokenizer, data_root, given)
    record = {"source": source, "vocab_size": vocab_size}
    marker = Path(data_root) / TRAINED_ON
    if (Path(data_root) / "tokenizer.json").is_file() and marker.is_file() and json.loads(marker.read_text()) == record:
        return load_tokenizer(data_root)

    def head() -> Iterator[str]:
        size = 0
        for text in texts():
            yield text
            size += len(text)
            if size >= TRAINING_CHARACTERS:
                return

    tokenizer = train_tokenizer(list(head()), vocab_size)
    Path(data_root).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(data_root))
    marker.write_text(json.dumps(record))
    return tokenizer


def encode_split(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Every document's ids followed by EOS, concatenated (the smallest dtype that holds the vocabulary)."""
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.int32
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    return np.asarray(ids, dtype=dtype)


def synthesize(out: Path, vocab_size: int = 4096, corpus: str = "", tokenizer: str = "") -> None:
    """Write the corpus's token ids and its tokenizer under ``out``: trained on the train split
    with ``vocab_size`` entries, or ``tokenizer`` (a ``save_pretrained`` folder or a Hub name) reused."""
    out = Path(out)
    files = folder_files(Path(corpus)) if corpus else stdlib_files()
    texts = {
        split: [path.read_text(encoding="utf-8", errors="replace") for path in paths] for split, paths in files.items()
    }
    tok = hub.load_tokenizer(tokenizer, {}) if tokenizer else train_tokenizer(texts["train"], vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"source": corpus or "stdlib", "vocab_size": len(tok), "splits": {}}
    for split in SPLITS:
        ids = encode_split(tok, texts[split])
        np.save(out / f"{split}.npy", ids)
        summary["splits"][split] = {  # type: ignore[index]
            "tokens": int(len(ids)),
            "files": {path.name: hashlib.sha256(path.read_bytes()).hexdigest()[:16] for path in files[split]},
        }
    tok.save_pretrained(str(out))
    (out / CORPUS_FILE).write_text(json.dumps(summary, indent=1))


def read_tokens(root: Path, split: str) -> np.ndarray:
    path = Path(root) / f"{split}.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; make the data with `raytpu data synth causal_lm --out {root}`")
    return np.load(path, mmap_mode="r")


def vocabulary_size(root: Path) -> int:
    """Entries of the tokenizer saved under ``root`` (its ``corpus.json``)."""
    return int(json.loads((Path(root) / CORPUS_FILE).read_text())["vocab_size"])


class PackedBlocks(Dataset):
    """A split's token stream cut into consecutive blocks of ``length`` tokens (the last partial
    block dropped): every item has the same shape, so nothing is padded and no attention mask is
    needed; a block may span a document boundary, marked by EOS, as in Transformers' ``run_clm``."""

    def __init__(self, tokens: np.ndarray, length: int) -> None:
        self.tokens, self.length = tokens, length

    def __len__(self) -> int:
        return len(self.tokens) // self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        block = self.tokens[index * self.length : (index + 1) * self.length]
        return {"input_ids": torch.from_numpy(block.astype(np.int64))}


def unigram_perplexity(train: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """Perplexity on ``held_out`` of token frequencies counted on ``train`` (add-one smoothed):
    the baseline a language model has to beat."""
    counts = np.bincount(np.asarray(train, dtype=np.int64), minlength=vocab_size).astype(np.float64) + 1
    log_probs = np.log(counts / counts.sum())
    return float(np.exp(-log_probs[np.asarray(held_out, dtype=np.int64)].mean()))
