"""The causal LM on a corpus in S3, streamed by Ray Data on a real multi-node Ray cluster on this machine.

Run by ``tests/test_corpus_ray.py`` as ``python -m tests.corpus_cluster OUT`` (a Ray cluster of its
own, apart from the test session's instance), with the S3 server's endpoint and keys in the
environment, which every node reads. A head with one CPU (where the tokenizing tasks and the feeder
run, as on a cluster of a CPU head and accelerator hosts) and two worker nodes of one CPU each, one
training worker on each: the JSON-lines and parquet shards in ``s3://BUCKET/corpus-cluster/`` train
the causal LM at ``seq_len`` 256, then 512. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

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


def main(out: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from raytpu import cli
    from raytpu.corpus.index import read_index

    write_shards(out / "shards", stdlib_documents(60_000), jsonl=3, parquet=2)
    upload(out / "shards", CORPUS)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    report: dict[str, object] = {}
    try:
        for index in range(2):
            folder = out / f"node{index}-tmp"
            folder.mkdir()
            cluster.add_node(num_cpus=1, env_vars={"TMPDIR": str(folder)})
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        for length in (256, 512):
            where = [f"data.path={out / f'prepared-{length}'}", "--output_dir", str(out / "runs")]
            words = [
                "train",
                str(SMALL),
                *TINY,
                "--streaming",
                "--train_file",
                f"{CORPUS}/",
                "--block_size",
                str(length),
            ]
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
        print(json.dumps(report), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
