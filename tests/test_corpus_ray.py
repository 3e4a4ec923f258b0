"""A user's corpus streamed through Ray Data (``data.loader=ray`` with ``data.train_files``): the
index counted by Ray Data tasks, the feeder handing out each step's blocks the same at every size
and from any step, and runs of the causal LM on 2 Ray workers that fail and resume, then go on at 1
worker, training at every step exactly the blocks the order says (``raytpu.corpus``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from raytpu import cli
from raytpu.corpus.feeder import StreamSpec, start_feeder, stop_feeders
from raytpu.corpus.index import Sources, corpus_index, read_index
from raytpu.corpus.order import EpochOrder
from raytpu.corpus.packing import Packing, TokenizerEncoder, count_unit
from raytpu.corpus.sources import find_units
from tests.conftest import ROOT
from tests.corpus_files import WordEncoder, expected_steps, row_hash, stdlib_documents, steps_seen, write_shards

SMALL = ROOT / "jobs" / "causal_lm" / "small.yaml"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus") / "train"
    write_shards(folder, stdlib_documents(20_000), jsonl=3, parquet=2)
    return folder


def taken(feeder, epoch: int, step: int, workers: int, accum: int) -> Counter:
    import ray

    rows = [ray.get(feeder.take.remote(epoch, step, rank, workers, accum)) for rank in range(workers)]
    return Counter(row_hash(row) for part in rows for row in part)


def test_the_feeder_streams_each_step_s_blocks_at_any_size_and_from_any_step(ray_session, shards, tmp_path):
    units = find_units([str(shards)], "data.train_files")
    packing = Packing(WordEncoder(), 16)
    index = corpus_index(tmp_path, Sources(tuple(units), (), 0.0), WordEncoder(), 16, "text")
    counts = tuple(count.blocks for count in index.train_counts)
    assert counts == tuple(count_unit(unit, packing).blocks for unit in units)  # Ray Data tasks count as one process
    order = EpochOrder.make(counts, global_batch=8, window=24, seed=5, shuffle=True)
    expected = expected_steps(units, order, packing, epochs=2)
    try:
        feeder = start_feeder("test-corpus-straight", StreamSpec(tuple(units), order, packing))
        straight = [taken(feeder, epoch, step, 2, 1) for epoch in range(2) for step in range(order.steps)]
        assert straight == expected
        resumed = start_feeder("test-corpus-resumed", StreamSpec(tuple(units), order, packing))
        later = [taken(resumed, 1, step, 1, 2) for step in range(3, order.steps)]  # one worker, two micro-batches
        assert later == expected[order.steps + 3 :]
        import ray

        assert ray.get(resumed.describe.remote())["held"] <= 5  # windows kept: bounded whatever the corpus
        reseeded = EpochOrder.make(counts, global_batch=8, window=24, seed=6, shuffle=True)
        other = start_feeder("test-corpus-reseeded", StreamSpec(tuple(units), reseeded, packing))
        assert taken(other, 0, 0, 2, 1) != expected[0]
    finally:
        stop_feeders()


# ------------------------------------------------------------------ the causal LM on it
#: a 1-layer model on 64-token blocks, a global batch of 8: steps take milliseconds
TINY = ["job.model_config.hidden_size=32", "job.model_config.intermediate_size=64",
        "job.model_config.num_hidden_layers=1", "job.model_config.num_attention_heads=2",
        "job.model_config.num_key_value_heads=1", "job.vocab_size=512",
        "job.seq_len=64", "job.sample_tokens=0", "data.global_batch_size=8", "data.loader=ray", "loop.log_every=2",
        "--save_steps", "4", "--eval_steps", "8", "--max_eval_samples", "8", "--validation_split_percentage", "10",
        "data.shuffle_buffer=16", "logging.progress_bar=false"]  # fmt: skip


@pytest.fixture(scope="module")
def streamed(ray_session, shards, tmp_path_factory):
    """The causal LM on the shards: 2 workers fail at step 7 and are restarted from step 4 by Ray
    (checkpoint.max_failures=1), end at step 12; the same command then goes on at 1 worker to step
    20, past the end of the first epoch."""
    out = tmp_path_factory.mktemp("streamed")
    faulty = out / "faulty.yaml"
    faulty.write_text(SMALL.read_text().replace("name: causal_lm\n", "name: tests.faulty_lm\n", 1))
    seen = out / "seen"
    seen.mkdir()
    where = ["--train_file", str(shards), f"data.path={out / 'prepared'}", "--output_dir", str(out / "runs")]
    common = [str(faulty), *TINY, *where, f"job.seen_dir={seen}", "--run_name", "lm"]
    first = ["job.fail_at_step=7", "checkpoint.max_failures=1", "loop.max_steps=12"]
    assert cli.main(["train", *common, *first]) == 0
    index_written = (out / "prepared" / "corpus_index.json").stat().st_mtime_ns
    assert cli.main(["train", *common, "loop.max_steps=20", "scaling.num_workers=1"]) == 0
    assert (out / "prepared" / "corpus_index.json").stat().st_mtime_ns == index_written  # counted once
    return out, seen


def test_every_step_trains_the_blocks_of_the_order_through_a_restart_and_a_resize(streamed):
    from raytpu.jobs.causal_lm import corpus

    out, seen = streamed
    index = read_index(out / "prepared")
    units = list(index.sources.train)
    encoder = TokenizerEncoder.of(corpus.load_tokenizer(out / "prepared"))
    packing = index.sources.packings(encoder, 64, "text")[0]
    order = EpochOrder.make(tuple(c.blocks for c in index.train_counts), 8, 16, seed=0, shuffle=True)
    assert 6 <= order.steps < 20, order.steps  # the run crosses an epoch's end
    expected = expected_steps(units, order, packing, epochs=2)
    trained = steps_seen(seen)
    assert sorted(trained) == list(range(1, 21))
    assert [trained[step] for step in range(1, 21)] == expected[:20]
    summary = json.loads((out / "runs" / "lm" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 20


def test_a_bad_file_past_the_first_is_one_line_from_the_index_s_tasks(ray_session, tmp_path, capsys):
    """Streamed, a corpus's first file is read before Ray is joined; a later one that is not what its
    suffix says is found by the Ray Data task that counts it, and said in one line naming it."""
    from tests.test_corpus import docs, write_jsonl, write_zst

    first = write_jsonl(tmp_path / "a.jsonl", docs(200))
    bad = write_zst(tmp_path)
    words = ["train", str(SMALL), "--streaming", "--train_file", f"{first},{bad}", "--validation_file", str(first),
             f"data.path={tmp_path / 'p'}", "--output_dir", str(tmp_path / "runs"), "job.seq_len=32"]  # fmt: skip
    code = cli.main(words)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("raytpu: error:")]
    assert code == 2 and len(errors) == 1 and "t.jsonl.zst: not a zst file, as its suffix says" in errors[0], errors
    assert not list(tmp_path.glob("runs/*/checkpoint_*"))
