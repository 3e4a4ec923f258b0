"""Instruction and chat fine-tuning data, in the formats TRL's ``SFTTrainer`` takes: conversational
rows (``messages``: a list of ``{role, content}``), prompt-completion rows (``prompt`` and
``completion``, as text or as messages) and plain text (``data.text_column``).

Each row is tokenized as TRL tokenizes it: a conversation through the tokenizer's chat template
(``apply_chat_template``, or the one of ``job.chat_template_path``), text with an end-of-text token
added where it lacks one; its labels are its ids where the loss is taken and -100 elsewhere: the
assistant's tokens alone with ``job.assistant_only_loss`` (the template's ``{% generation %}``
markers), the completion alone with ``job.completion_only_loss`` (on by default, as in TRL).

Rows are then packed best-fit (``job.packing``: TRL's ``pack_dataset``, ``bfd``: a conversation is
never split, one longer than ``job.seq_len`` is cut), or kept one a row and cut to ``job.seq_len``;
those left with no label are dropped. On the torch path the driver does this once into the data
root (:func:`prepare`); streamed (``data.loader: ray``), the corpus path's tasks do it a group of a
file's rows at a time (:class:`StreamedRows`, ``raytpu.corpus.rows``). Every row is padded to
``job.seq_len`` (one shape: XLA compiles one step) and carries each token's position in its own
document and the document's id (``segments``; padding -1), from which the step's attention mask
keeps attention inside each document.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

#: roles a conversation's turns may have
ROLES = ("system", "developer", "user", "assistant", "tool")
#: the record beside the prepared rows of what they were made from
MADE_FROM = "sft.json"
#: the first held-out prompts, beside the held-out rows (continued at each evaluation)
PROMPTS = "prompts.json"
#: the held-out prompts kept
KEPT_PROMPTS = 4
#: the folder of a streamed run's held-out prompts (its rows are read by the corpus path's tasks)
STREAMED = "sft-stream"
#: rows of each side a streamed run encodes on the driver before any worker starts
CHECKED_ROWS = 64


@dataclass(frozen=True)
class Tokenizing:
    """How rows become ids and labels (the job's settings)."""

    text_column: str = "text"
    assistant_only_loss: bool = False
    completion_only_loss: bool = True
    chat_template: str | None = None


def kind_of(row: dict[str, Any], text_column: str) -> str:
    """``messages``, ``prompt`` (and its completion) or ``text``; a row of none is refused."""
    if "messages" in row:
        return "messages"
    if "prompt" in row:
        return "prompt"
    if text_column in row:
        return "text"
    raise ValueError(
        f"a row has the fields {sorted(row)}: give conversations (messages), prompt and completion, or text "
        f"(data.text_column={text_column!r})"
    )


def check_turns(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(f"{where}: a conversation is a list of {{role, content}} turns")
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        raise ValueError(f"{where}: unknown role {', '.join(unknown)} (roles: {', '.join(ROLES)})")


def template(tokenizer: Any, messages: list[dict[str, Any]], how: Tokenizing, row: dict[str, Any], **kw: Any) -> Any:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    return tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, chat_template=how.chat_template, tools=tools, **kw
    )


def common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def tokenized(row: dict[str, Any], tokenizer: Any, how: Tokenizing, where: str) -> tuple[list[int], list[int]]:
    """A row's ids and labels (-100 where no loss is taken), as TRL's ``SFTTrainer`` makes them."""
    kind, eos = kind_of(row, how.text_column), tokenizer.eos_token
    masks: list[list[int]] = []
    if kind == "text":
        text = str(row[how.text_column])
        ids = tokenizer(text if text.endswith(eos) else text + eos)["input_ids"]
    elif kind == "messages":
        check_turns(row["messages"], where)
        done = template(tokenizer, row["messages"], how, row, return_assistant_tokens_mask=how.assistant_only_loss)
        ids = list(done["input_ids"])
        if how.assistant_only_loss:
            masks.append(assistant_mask(done, row["messages"], where))
    else:
        if "completion" not in row:
            raise ValueError(f"{where}: a row with a prompt needs a completion (it has {sorted(row)})")
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list):
            check_turns(prompt + completion, where)
            prompt_ids = list(template(tokenizer, prompt, how, row, add_generation_prompt=True)["input_ids"])
            aol = how.assistant_only_loss
            done = template(tokenizer, prompt + completion, how, row, return_assistant_tokens_mask=aol)
            ids = list(done["input_ids"])
            if aol:
                masks.append(assistant_mask(done, prompt + completion, where))
        else:
            completion = completion if completion.endswith(eos) else completion + eos
            prompt_ids = tokenizer(prompt)["input_ids"]
            ids = tokenizer(prompt + completion)["input_ids"]
        start = common_prefix(prompt_ids, ids)
        if how.completion_only_loss:
            masks.append([0] * start + [1] * (len(ids) - start))
    labels = [token if all(mask[i] for mask in masks) else -100 for i, token in enumerate(ids)]
    return ids, labels


def assistant_mask(done: Any, messages: list[dict[str, Any]], where: str) -> list[int]:
    mask = list(done.get("assistant_masks") or [])
    if 1 in mask:
        return mask
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ValueError(f"{where}: a conversation with no assistant turn, and job.assistant_only_loss is set")
    raise ValueError(
        "job.assistant_only_loss: the chat template marks no assistant tokens (it has no {% generation %} ... "
        "{% endgeneration %} around the assistant's turns); give one that does with --chat_template_path, or drop "
        "--assistant_only_loss"
    )


def rows_of(units: Any, kind: str, text_column: str, holdout: float) -> Iterator[tuple[dict[str, Any], str]]:
    """The rows of ``units`` (with where each is, for an error), those ``kind`` keeps of a held-out
    share (``valid``: the held-out ones; ``train``: the rest; ``all``)."""
    from raytpu.corpus.packing import held_out
    from raytpu.corpus.sources import documents, records

    for unit in units:
        batches = (
            records(unit)
            if unit.format != "text"
            else ([{text_column: t} for t in b] for b in documents(unit, text_column))
        )
        index = 0
        for batch in batches:
            for row in batch:
                out = held_out(unit.name, index, holdout) if holdout else None
                if kind == "all" or out is None or out == (kind == "valid"):
                    yield row, f"{unit.name} row {index + 1}"
                index += 1


def prepare(root: Path, sources: Any, tokenizer: Any, how: Tokenizing, length: int, packing: bool) -> dict[str, Any]:
    """Both splits' rows tokenized, cut or packed into ``root`` (``sft-train``, ``sft-valid``: datasets
    folders), left as they are when made from the same rows and settings; the record of them."""
    from raytpu.corpus.sources import fingerprint

    key = hashlib.sha256(
        json.dumps(
            [
                fingerprint(sources.train),
                fingerprint(sources.valid),
                sources.holdout,
                length,
                packing,
                how.__dict__,
                tokenizer.backend_tokenizer.to_str()[:100_000],
            ]
        ).encode()  # fmt: skip
    ).hexdigest()[:16]
    record_path = Path(root) / MADE_FROM
    if record_path.is_file() and json.loads(record_path.read_text()).get("fingerprint") == key:
        return json.loads(record_path.read_text())
    Path(root).mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"fingerprint": key, "packing": packing, "splits": {}}
    sides = (("train", sources.train, "train"), ("valid", sources.valid, "valid" if sources.holdout else "all"))
    for split, units, kind in sides:
        rows = list(rows_of(units, kind, how.text_column, sources.holdout))
        examples = [tokenized(row, tokenizer, how, where) for row, where in rows]
        record["splits"][split] = write_split(Path(root) / f"sft-{split}", examples, length, packing)
    asked = (prompt_ids(row, tokenizer, how) for row, _ in rows)  # the held-out side's
    prompts = [ids[: length - 1] for ids in asked if ids][:KEPT_PROMPTS]
    (Path(root) / "sft-valid" / PROMPTS).write_text(json.dumps(prompts))
    record_path.write_text(json.dumps(record))
    return record


def fit(examples: list[tuple[list[int], list[int]]], length: int, packing: bool) -> tuple[Any, dict[str, int]]:
    """Examples as rows of at most ``length`` tokens (a ``datasets.Dataset`` of ``input_ids``,
    ``labels`` and ``seq_lengths``): packed best-fit, or one example a row, cut to ``length``;
    rows left with no label dropped. What went in, in numbers."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()  # Map's bars: the console is the run's
    longer = sum(len(ids) > length for ids, _ in examples)
    cut = [(ids[:length], labels[:length]) for ids, labels in examples]
    kept = [(ids, labels) for ids, labels in cut if any(label != -100 for label in labels)]
    table = Dataset.from_dict({"input_ids": [ids for ids, _ in kept], "labels": [labels for _, labels in kept]})
    if packing:
        from trl.data_utils import pack_dataset

        table = pack_dataset(table, length, "bfd")
    else:
        table = table.map(lambda row: {"seq_lengths": [len(row["input_ids"])]})
    return table, {"examples": len(examples), "truncated": longer, "dropped": len(cut) - len(kept),
                   "rows": len(table), "tokens": sum(len(ids) for ids, _ in kept)}  # fmt: skip


def write_split(folder: Path, examples: list[tuple[list[int], list[int]]], length: int, packing: bool) -> dict:
    """The split's rows (:func:`fit`) as a datasets folder; what it holds, in numbers."""
    table, counts = fit(examples, length, packing)
    table.save_to_disk(str(folder))
    return counts


class StreamedRows:
    """The streamed path's :class:`~raytpu.corpus.rows.RowEncoder`: rows tokenized as
    :func:`tokenized` and fitted as :func:`fit`, in the corpus path's tasks (the tokenizer travels
    with it)."""

    def __init__(self, tokenizer: Any, how: Tokenizing, packing: bool, pad_id: int) -> None:
        self.tokenizer, self.how, self.packing, self.pad_id = tokenizer, how, packing, pad_id
        self.text_column, self.vocab_size = how.text_column, len(tokenizer)
        made = [how.__dict__, packing, pad_id, tokenizer.chat_template, tokenizer.backend_tokenizer.to_str()]
        self.fingerprint = hashlib.sha256(json.dumps(made, default=str).encode()).hexdigest()[:16]

    def encode_rows(self, rows: list[dict[str, Any]], where: list[str], length: int) -> Any:
        from raytpu.corpus.rows import EncodedRows, fixed_rows

        examples = [tokenized(row, self.tokenizer, self.how, at) for row, at in zip(rows, where)]
        table, counts = fit(examples, length, self.packing)
        packed = [(row["input_ids"], row["labels"], row["seq_lengths"]) for row in table]
        return EncodedRows(fixed_rows(packed, length, self.pad_id), len(examples), counts["truncated"],
                           counts["tokens"])  # fmt: skip


def check_stream(root: Path, sources: Any, encoder: StreamedRows, length: int) -> None:
    """The streamed path's rows checked before any worker starts (the first :data:`CHECKED_ROWS` of
    each side encoded: a bad row is one line), and the held-out side's first prompts kept in
    ``root/sft-stream`` (continued at each evaluation)."""
    sides = (("train", sources.train, "train"), ("valid", sources.valid, "valid" if sources.holdout else "all"))
    for _, units, kind in sides:
        first = list(itertools.islice(rows_of(units, kind, encoder.text_column, sources.holdout), CHECKED_ROWS))
        encoder.encode_rows([row for row, _ in first], [where for _, where in first], length)
    asked = (prompt_ids(row, encoder.tokenizer, encoder.how) for row, _ in first)  # the held-out side's
    prompts = [ids[: length - 1] for ids in asked if ids][:KEPT_PROMPTS]
    (Path(root) / STREAMED).mkdir(parents=True, exist_ok=True)
    (Path(root) / STREAMED / PROMPTS).write_text(json.dumps(prompts))


class Rows(Dataset):
    """One split's prepared rows, each padded to ``length``: ``input_ids``, ``labels`` (-100 where no
    loss), ``position_ids`` (counted from 0 in each document) and ``segments`` (the document a token
    is in; -1: padding)."""

    def __init__(self, folder: Path, length: int, pad_id: int) -> None:
        from datasets import load_from_disk

        self.rows, self.length, self.pad_id = load_from_disk(str(folder)), length, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        from raytpu.corpus.rows import fixed_rows, rows_batch

        row = self.rows[index]
        fixed = fixed_rows([(row["input_ids"], row["labels"], row["seq_lengths"])], self.length, self.pad_id)
        return {name: value[0] for name, value in rows_batch(fixed).items()}


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """``(batch, 1, length, length)``: each token attends to the tokens at or before it in its own
    document (padding to padding), made from the rows' segments alone (one shape)."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def held_out_prompts(folder: Path, count: int) -> list[list[int]]:
    """The first ``count`` prompts of the held-out rows (written by :func:`prepare`)."""
    path = Path(folder) / PROMPTS
    return json.loads(path.read_text())[:count] if path.is_file() else []


def prompt_ids(row: dict[str, Any], tokenizer: Any, how: Tokenizing) -> list[int] | None:
    """What a row's model is asked (a conversation up to its last assistant turn, through the template
    with the assistant's turn opened; a prompt), or None for text."""
    kind = kind_of(row, how.text_column)
    if kind == "text":
        return None
    if kind == "prompt":
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return list(tokenizer(prompt)["input_ids"])
        return list(template(tokenizer, prompt, how, row, add_generation_prompt=True)["input_ids"])
    turns = row["messages"]
    last = max((i for i, turn in enumerate(turns) if turn["role"] == "assistant"), default=len(turns))
    return list(template(tokenizer, turns[:last], how, row, add_generation_prompt=True)["input_ids"])
