"""The causal LM on a corpus in S3, streamed by Ray Data on a real multi-node Ray cluster on this
machine: a scenario of ``tests/multinode_cluster.py``, with the S3 server's endpoint and keys in
the environment, which every node reads.

The cluster's two worker nodes of one CPU each, one training worker on each, and a third node of
one CPU added for the scenario, where the tokenizing tasks and the feeder run (as on a cluster of a
CPU host and accelerator hosts): the JSON-lines and parquet shards in ``s3://BUCKET/corpus-cluster/``
train the causal LM at ``seq_len`` 256, then 512. Returns what it saw.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.corpus_files import stdlib_documents, write_shards
from tests.stores import BUCKET

SMALL = Path(__file__).resolve().parents[1] / "jobs" / "causal_lm" / "small.yaml"
CORPUS = f"s3://{BUCKET}/corpus-cluster"
#: a 1-layer model, a global batch of 8 blocks, 4 steps
TINY = ["job.model_config.hidden_size=32", "job.model_config.intermediate_size=64",
        "job.model_config.num_hidden_layers=1", "job.model_config.num_attention_heads=2",
        "job.model_config.num_key_value_heads=1", "job.model_config.max_position_embeddings=512",
        "job.vocab_size=512", "job.sample_tokens=0", "data.global_batch_size=8", "scaling.num_workers=2",
        "loop.max_steps=4", "loop.log_every=2", "--eval_steps", "4", "--save_steps", "4", "--max_eval_samples", "8",
        "--validation_split_percentage", "10", "logging.progress_bar=false"]  # fmt: skip


def upload(folder: Path, location: str) -> None:
    import pyarrow.fs as pafs

    from raytpu.storage.filesystems import filesystem

    fs, base = filesystem(location)
    pafs.copy_files(str(folder), base, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def scenario(cluster: Any, out: Path, node_tmp: list[Path]) -> dict[str, Any]:
    """The two runs on ``cluster``, with a node of one CPU added for their tasks (removed after)."""
    from raytpu import cli
    from raytpu.corpus.index import read_index

    write_shards(out / "shards", stdlib_documents(60_000), jsonl=3, parquet=2)
    upload(out / "shards", CORPUS)
    (out / "tasks-tmp").mkdir()
    tasks = cluster.add_node(num_cpus=1, env_vars={"TMPDIR": str(out / "tasks-tmp")})
    cluster.wait_for_nodes()
    report: dict[str, Any] = {}
    try:
        for length in (256, 512):
            where = [f"data.path={out / f'prepared-{length}'}", "--output_dir", str(out / "runs")]
            words = ["train", str(SMALL), *TINY, "--streaming", "--train_file", f"{CORPUS}/"]
            words += ["--block_size", str(length)]
            code = cli.main([*words, *where, "--run_name", f"lm-{length}"])
            summary = json.loads((out / "runs" / f"lm-{length}" / "summary.json").read_text())
            index = read_index(out / f"prepared-{length}")
            report[str(length)] = {
                "code": code,
                "step": summary["step"],
                "metrics": summary["metrics"],
                "blocks": index.train_blocks if index else None,
                "units": [unit.root for unit in index.sources.train] if index else [],
            }
    finally:
        cluster.remove_node(tasks)
    return report
