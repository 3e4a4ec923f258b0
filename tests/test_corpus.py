"""A user's text corpus without Ray: finding and reading the files in every format, packing into
blocks, the held-out share, the epoch order that every size of a run agrees on, the torch path's
token files, the Transformers data flags and their one-line refusals (``raytpu.corpus``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytpu.config import load_config
from raytpu.corpus.index import Sources, find_sources
from raytpu.corpus.order import EpochOrder
from raytpu.corpus.packing import Packing, count_unit, held_out, unit_blocks
from raytpu.corpus.sources import CorpusError, documents, find_units
from raytpu.corpus.tokens import read_split, read_summary, tokenize_corpus
from tests.conftest import ROOT
from tests.corpus_files import WordEncoder, steps_seen

SMALL = str(ROOT / "jobs" / "causal_lm" / "small.yaml")


def docs(count: int, start: int = 0) -> list[str]:
    return [" ".join(f"w{start + index}x{word}" for word in range(3 + (start + index) % 5)) for index in range(count)]


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> Path:
    path.write_text("".join(json.dumps({column: text, "n": index}) + "\n" for index, text in enumerate(texts)))
    return path


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    root.mkdir()
    write_jsonl(root / "a.jsonl", docs(30))
    pq.write_table(pa.table({"text": docs(20, 100)}), root / "b.parquet")
    (root / "c.md").write_text("a whole file is one document")
    (root / "_SUCCESS").write_text("")  # a marker, never read
    return root


def texts_of(units, column="text") -> list[str]:
    return [text for unit in units for batch in documents(unit, column) for text in batch]


def test_a_folder_glob_or_file_is_read_in_every_format(corpus_dir: Path):
    units = find_units([str(corpus_dir)], "data.train_files")
    assert [unit.name for unit in units] == ["a.jsonl", "b.parquet", "c.md"]
    assert texts_of(units) == [*docs(30), *docs(20, 100), "a whole file is one document"]
    assert [u.name for u in find_units([f"{corpus_dir}/*.jsonl", str(corpus_dir / "a.jsonl")], "x")] == ["a.jsonl"]
    array = corpus_dir.parent / "array.json"
    array.write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    assert texts_of(find_units([str(array)], "x")) == ["one", "two"]


def test_a_datasets_folder_and_its_validation_split(tmp_path: Path):
    datasets = pytest.importorskip("datasets")
    train, valid = datasets.Dataset.from_dict({"text": docs(5)}), datasets.Dataset.from_dict({"text": docs(3, 50)})
    datasets.Dataset.from_dict({"text": docs(4)}).save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": train, "validation": valid}).save_to_disk(str(tmp_path / "dict"))
    assert texts_of(find_units([str(tmp_path / "single")], "x")) == docs(4)
    cfg, _ = load_config(SMALL, ["--dataset_name", str(tmp_path / "dict"), "--text_column_name", "text"])
    sources = find_sources(cfg)
    assert texts_of(sources.train) == docs(5) and texts_of(sources.valid) == docs(3, 50)
    assert sources.holdout == 0


@pytest.mark.parametrize(
    "content, column, message",
    [
        ('{"body": "x"}\n', "text", r"no text column 'text' \(it has \['body'\]\)"),
        ("not json at all\n", "text", "not JSON lines"),
        ('{"text": 5}\n', "text", "holds int64, not text"),
    ],
)
def test_a_wrong_file_or_column_is_one_line_naming_the_file(tmp_path: Path, content: str, column: str, message: str):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(CorpusError, match=message) as caught:
        texts_of(find_units([str(path)], "x"), column)
    assert "bad.jsonl" in str(caught.value) and "\n" not in str(caught.value)


def test_a_missing_parquet_column_names_the_columns_there_are(tmp_path: Path):
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), tmp_path / "t.parquet")
    with pytest.raises(CorpusError, match=r"no text column 'text' \(it has \['content', 'id'\]\)"):
        texts_of(find_units([str(tmp_path / "t.parquet")], "x"))


def test_missing_files_and_a_silent_bucket_are_refused_in_one_line(tmp_path: Path, monkeypatch):
    with pytest.raises(CorpusError, match="does not exist"):
        find_units([str(tmp_path / "absent.jsonl")], "data.train_files")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(CorpusError, match="cannot be read: the store does not answer: check AWS_ENDPOINT_URL"):
        find_units(["s3://corpus-bucket/shards/"], "data.train_files")


def test_transformers_data_flags_set_the_corpus_keys(tmp_path: Path):
    cfg, _ = load_config(
        SMALL,
        ["--train_file", "a.jsonl,b.jsonl", "--validation_file", "v.jsonl", "--text_column_name", "body",
         "--validation_split_percentage", "10", "--tokenizer_name", "./tok", "--block_size", "256",
         "--max_eval_samples", "64", "--streaming"],
    )  # fmt: skip
    data = cfg.data
    assert (data.train_files, data.validation_files, data.text_column) == (["a.jsonl", "b.jsonl"], ["v.jsonl"], "body")
    assert (data.validation_split_percentage, data.max_eval_samples, data.loader) == (10, 64, "ray")
    assert (cfg.job.tokenizer, cfg.job.seq_len) == ("./tok", 256)


def test_units_pack_into_blocks_joined_by_eos_and_a_skip_resumes_inside_a_unit(corpus_dir: Path):
    unit = find_units([str(corpus_dir / "a.jsonl")], "x")[0]
    packing = Packing(WordEncoder(), 7)
    blocks = np.concatenate(list(unit_blocks(unit, packing)))
    ids = [token for ids in WordEncoder().encode_batch(docs(30)) for token in (*ids, 0)]
    assert blocks.dtype == np.uint16 and blocks.shape == (len(ids) // 7, 7)
    assert blocks.reshape(-1).tolist() == ids[: len(blocks) * 7]
    assert count_unit(unit, packing).blocks == len(blocks)
    assert np.array_equal(np.concatenate(list(unit_blocks(unit, packing, skip=5))), blocks[5:])


def test_the_held_out_share_is_fixed_by_name_and_place_and_near_its_percentage():
    chosen = [held_out("shard-3.jsonl", index, 5.0) for index in range(20000)]
    assert 0.04 < np.mean(chosen) < 0.06
    assert chosen == [held_out("shard-3.jsonl", index, 5.0) for index in range(20000)]
    assert chosen != [held_out("shard-4.jsonl", index, 5.0) for index in range(20000)]


def test_train_and_validation_split_the_documents_without_overlap(corpus_dir: Path):
    units = tuple(find_units([str(corpus_dir / "a.jsonl")], "x"))
    train, valid = Sources(units, units, 20.0).packings(WordEncoder(), 1, "text")
    kept = [(train.kept(units[0], i), valid.kept(units[0], i)) for i in range(30)]
    assert all(a != b for a, b in kept) and 0 < sum(b for _, b in kept) < 30


def step_blocks(order: EpochOrder, epoch: int, step: int, workers: int, accum: int) -> list[int]:
    """The step's blocks (as places in the epoch's shuffled stream) over every rank and micro-batch."""
    taken = []
    for rank in range(workers):
        window, places = order.rows(epoch, step, rank, workers, accum)
        taken += (window * order.window + order.permutation(epoch, window)[places]).tolist()
    return sorted(taken)


def test_a_step_trains_the_same_blocks_at_every_size_and_each_block_once_an_epoch():
    order = EpochOrder.make((7, 0, 13, 5, 21), global_batch=4, window=10, seed=3, shuffle=True)
    assert order.window == 12 and order.steps == 11 and order.windows == 4
    for step in range(order.steps):
        at_two = step_blocks(order, 0, step, workers=2, accum=1)
        assert at_two == step_blocks(order, 0, step, workers=1, accum=2) == step_blocks(order, 0, step, 4, 1)
    every = [block for step in range(order.steps) for block in step_blocks(order, 0, step, 2, 1)]
    assert sorted(every) == list(range(order.used))
    assert order.unit_order(0) != order.unit_order(1)  # a new order each epoch, the same for every seed's run
    assert order.unit_order(1) == EpochOrder.make((7, 0, 13, 5, 21), 4, 10, 3, True).unit_order(1)


def test_a_window_starts_reading_at_the_unit_it_begins_in():
    order = EpochOrder.make((7, 0, 13, 5), global_batch=2, window=6, seed=0, shuffle=False)
    assert order.start(0, 0) == ([0, 1, 2, 3], 0)
    assert order.start(0, 1) == ([0, 1, 2, 3], 6)
    assert order.start(0, 2) == ([2, 3], 5)
    assert order.start(0, 4) == ([3], 4)


def test_the_torch_path_writes_each_split_once_and_again_when_a_file_changes(corpus_dir: Path, tmp_path: Path):
    units = tuple(find_units([str(corpus_dir)], "x"))
    sources = Sources(units, units, 10.0)
    root = tmp_path / "tokens"
    summary = tokenize_corpus(root, sources, WordEncoder(), "text")
    train, valid = read_split(root, "train"), read_split(root, "valid")
    assert np.count_nonzero(train == 0) + np.count_nonzero(valid == 0) == 51  # one EOS a document
    assert np.array_equal(read_split(root, "test"), valid)
    modified = (root / "train.npy").stat().st_mtime_ns
    assert tokenize_corpus(root, sources, WordEncoder(), "text") == summary
    assert (root / "train.npy").stat().st_mtime_ns == modified
    write_jsonl(corpus_dir / "a.jsonl", docs(31))
    changed = tuple(find_units([str(corpus_dir)], "x"))
    assert tokenize_corpus(root, Sources(changed, changed, 10.0), WordEncoder(), "text") != summary
    assert read_summary(root)["vocab_size"] == 1000


def test_block_counts_per_unit_match_what_the_packer_yields(corpus_dir: Path):
    packing = Packing(WordEncoder(), 5)
    for unit in find_units([str(corpus_dir)], "x"):
        blocks = sum(len(b) for b in unit_blocks(unit, packing))
        assert count_unit(unit, packing).blocks == blocks


# ------------------------------------------------------------------ runs on the torch path
#: a 1-layer Llama: steps of milliseconds
TINY_MODEL = ["job.model_config.hidden_size=32", "job.model_config.intermediate_size=64",
              "job.model_config.num_hidden_layers=1", "job.model_config.num_attention_heads=2",
              "job.model_config.num_key_value_heads=1"]  # fmt: skip


def lm_run(tmp_path: Path, *words: str) -> list[str]:
    """A tiny causal LM for a few steps in one local process."""
    return ["train", SMALL, "--local", "scaling.num_workers=1", "data.global_batch_size=4", "loop.max_steps=4",
            "job.seq_len=32", "job.sample_tokens=0", "logging.progress_bar=false", "--eval_steps", "4",
            "--output_dir", str(tmp_path / "runs"), *words]  # fmt: skip


def test_fine_tuning_a_saved_model_uses_its_own_tokenizer_and_exports(tmp_path: Path, capsys):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from raytpu import cli
    from raytpu.jobs.causal_lm import corpus

    texts = docs(200)
    tokenizer = corpus.train_tokenizer(texts, 300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    train, valid = write_jsonl(tmp_path / "train.jsonl", texts), write_jsonl(tmp_path / "valid.jsonl", docs(40, 500))
    prepared = tmp_path / "prepared"
    words = ["--model_name_or_path", str(model_dir), "--train_file", str(train), "--validation_file", str(valid)]
    assert cli.main(lm_run(tmp_path, *words, f"data.path={prepared}")) == 0
    assert not (prepared / "tokenizer.json").exists()  # the model's own tokenizer, not one trained here
    ids = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert read_split(prepared, "train")[: len(ids)].tolist() == ids
    out = tmp_path / "exported"
    checkpoint = tmp_path / "runs" / "causal_lm-small" / "checkpoint_00000004"
    export = ["export", SMALL, *words, "job.seq_len=32", f"data.path={prepared}", "--checkpoint", str(checkpoint)]
    assert cli.main([*export, "--out", str(out)]) == 0
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(tokenizer)


def write_zst(folder: Path) -> Path:
    """A file named as zstd-compressed JSON lines that holds plain text."""
    path = folder / "t.jsonl.zst"
    path.write_text("not compressed\n")
    return path


@pytest.mark.parametrize(
    "make, words, message",
    [
        (lambda d: write_jsonl(d / "t.jsonl", docs(50), column="body"), [],
         r"t.jsonl: no text column 'text' \(it has \['body', 'n'\]\); set data.text_column"),
        (lambda d: (d / "t.jsonl").write_text("plain text, not json\n"), [], "t.jsonl: not JSON lines"),
        (lambda d: write_jsonl(d / "t.jsonl", docs(3)), ["--validation_file", "{d}/t.jsonl"],
         r"the train split of the corpus data.train_files=\['.*t.jsonl'\] \(\d+ training tokens, in blocks of 32\) "
         r"has 1 samples, fewer than one step of data.global_batch_size=4"),
        (lambda d: (d / "t.jsonl").write_text('{"text": "x"}\n'), ["--validation_file", "{d}/t.jsonl"],
         r"the corpus data.train_files=\['.*t.jsonl'\] \(\d+ training tokens, in blocks of 32\): its training "
         r"text holds fewer tokens than one block; add text or lower job.seq_len \(--block_size\)"),
        (write_zst, ["--train_file", "{d}/t.jsonl.zst"],
         r"t.jsonl.zst: not a zst file, as its suffix says \(ZSTD decompress failed"),
        (lambda d: write_jsonl(d / "t.jsonl", docs(50)), ["--validation_split_percentage", "0"],
         "no validation text: name data.validation_files"),
    ],
)  # fmt: skip
def test_bad_corpora_are_one_error_line(tmp_path: Path, capsys, make, words, message):
    import re

    from raytpu import cli

    make(tmp_path)
    words = [word.format(d=tmp_path) for word in words]
    code = cli.main(lm_run(tmp_path, "--train_file", str(tmp_path / "t.jsonl"), f"data.path={tmp_path / 'p'}", *words))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytpu: error:")]
    assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), errors


def test_the_torch_path_resumed_at_another_size_trains_every_step_s_blocks(tmp_path: Path):
    """Local processes on the torch path: 2 that fail at step 7 and 1 that resumes from step 4 train,
    step by step, the very blocks of 2 uninterrupted ones (each step's blocks over every rank)."""
    from raytpu import cli

    faulty = tmp_path / "faulty.yaml"
    faulty.write_text(Path(SMALL).read_text().replace("name: causal_lm\n", "name: tests.faulty_lm\n", 1))
    train, valid = (
        write_jsonl(tmp_path / "train.jsonl", docs(400)),
        write_jsonl(tmp_path / "valid.jsonl", docs(40, 900)),
    )
    common = ["train", str(faulty), "--local", "--train_file", str(train), "--validation_file", str(valid),
              f"data.path={tmp_path / 'prepared'}", "job.seq_len=16", "job.vocab_size=300", "job.sample_tokens=0",
              "data.global_batch_size=8", "loop.max_steps=12", "--save_steps", "4", "--eval_steps", "4",
              "--max_eval_samples", "8", "logging.progress_bar=false", "--output_dir", str(tmp_path / "runs"),
              *TINY_MODEL]  # fmt: skip
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    straight.mkdir(), interrupted.mkdir()
    assert cli.main([*common, "--run_name", "straight", f"job.seen_dir={straight}", "scaling.num_workers=2"]) == 0
    resumed = [*common, "--run_name", "resumed", f"job.seen_dir={interrupted}"]
    assert cli.main([*resumed, "scaling.num_workers=2", "job.fail_at_step=7"]) == 1
    assert cli.main([*resumed, "scaling.num_workers=1"]) == 0
    expected, trained = steps_seen(straight), steps_seen(interrupted)
    assert sorted(trained) == sorted(expected) == list(range(1, 13))
    assert [trained[step] for step in range(1, 13)] == [expected[step] for step in range(1, 13)]
