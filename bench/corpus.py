"""A user's corpus streamed by Ray Data (``data.loader=ray`` with ``data.train_files``), measured
side by side with one process running the same tokenizer over the same files.

The corpus: this Python's standard library re-emitted as documents (each function a document,
the whole library again and again until the size asked), as JSON-lines and parquet shards; the
tokenizer: the causal LM's byte-level BPE (4,096 entries) trained on its first 64 MB, as a run
without a tokenizer of its own makes it. Both sides run the tokenizer single-threaded
(``TOKENIZERS_PARALLELISM=false``), so a process is a core.

* ``single``: tokens/s of one process packing every file in order (``raytpu.corpus.packing``);
* ``side_by_side``: tokens/s of one plain process per CPU, each packing a share of the files: what the
  machine's cores give together (on a VM two vCPUs can be one physical core's two threads);
* ``index``: tokens/s of the index pass (Ray Data tasks on every CPU of a local Ray instance);
* ``ray``: tokens/s the feeder delivers to two consumers asking for every step of an epoch, as two
  workers do (read, tokenize, pack, shuffle, hand out), and per core against ``single``;
* ``driver``: this process's peak memory (RSS) while the index is counted and an epoch streamed, at
  the corpus's size and at a quarter of it;
* ``stall``: the share of a training run's step time spent waiting for input (its goodput record),
  ``raytpu train jobs/causal_lm/small.yaml`` fed from the JSON-lines shards on 2 local Ray workers.

    python bench/corpus.py [--mb 100] [--seq-len 512] [--steps 120] [--skip-train]

Targets: ``per_core_ratio`` at least 0.8, ``stall`` under 0.02, ``driver`` flat in the corpus size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from raytpu.config import load_config  # noqa: E402
from raytpu.corpus.feeder import StreamSpec, start_feeder, stop_feeders  # noqa: E402
from raytpu.corpus.index import Sources, corpus_index, sample_texts  # noqa: E402
from raytpu.corpus.order import EpochOrder  # noqa: E402
from raytpu.corpus.packing import Packing, unit_ids  # noqa: E402
from raytpu.corpus.sources import find_units, fingerprint  # noqa: E402
from raytpu.job import load_job  # noqa: E402
from tests.corpus_files import stdlib_documents, write_shards  # noqa: E402

CONFIG = ROOT / "jobs" / "causal_lm" / "small.yaml"


def make_corpus(folder: Path, megabytes: float) -> list[str]:
    """The standard library's documents, again and again, to ``megabytes`` of text, in 16 JSON-lines
    and 8 parquet shards; the shards' paths."""
    library = stdlib_documents(10**9)
    documents, size, copy = [], 0, 0
    while size < megabytes * 1e6:
        for text in library:
            documents.append(f"# copy {copy}\ndef {text}")
            size += len(documents[-1])
            if size >= megabytes * 1e6:
                break
        copy += 1
    return [str(path) for path in write_shards(folder, documents, jsonl=16, parquet=8)]


def encoder_for(shards: list[str], root: Path):
    cfg, _ = load_config(str(CONFIG), [])
    units = tuple(find_units(shards, "data.train_files"))
    texts = sample_texts(units, "text")
    return load_job("causal_lm").text_encoder(cfg, root, texts, fingerprint(units, "text"))


def single_process(units, packing: Packing) -> tuple[float, float]:
    """Tokens per second of one process packing every unit in order, and per CPU second."""
    started, cpu, tokens = time.perf_counter(), time.process_time(), 0
    for unit in units:
        for ids, _ in unit_ids(unit, packing):
            tokens += len(ids)
    return tokens / (time.perf_counter() - started), tokens / (time.process_time() - cpu)


def tokens_of(units, packing: Packing) -> int:
    return sum(len(ids) for unit in units for ids, _ in unit_ids(unit, packing))


def side_by_side(units, packing: Packing, processes: int) -> float:
    """Tokens/s of ``processes`` plain processes packing a share of the units each, side by side:
    what this machine's cores give together without Ray (two vCPUs may be one core's two threads)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.starmap(tokens_of, [([], packing)] * processes)  # the interpreters and imports, before timing
        started = time.perf_counter()
        tokens = sum(pool.starmap(tokens_of, [(units[index::processes], packing) for index in range(processes)]))
        return tokens / (time.perf_counter() - started)


def ray_workers_cpu() -> float:
    """CPU seconds used so far by this machine's Ray worker processes (tasks and actors: ``ray::``)."""
    import psutil

    total = 0.0
    for process in psutil.process_iter(["name", "cmdline"]):
        try:
            if (process.info["name"] or "").startswith("ray::") or " ray::" in " ".join(process.info["cmdline"] or []):
                times = process.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            continue
    return total


class PeakMemory:
    """This process's resident memory, sampled every 50 ms while in the ``with`` block."""

    def __enter__(self) -> PeakMemory:
        import psutil

        self.process, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.thread.join()


def ray_path(units, packing: Packing, root: Path, global_batch: int) -> dict[str, float]:
    """The index pass and one epoch through the feeder to two consumers; tokens/s and peak memory."""
    import ray

    with PeakMemory() as memory:
        started = time.perf_counter()
        index = corpus_index(root, Sources(tuple(units), (), 0.0), packing.encoder, packing.length, "text")
        counted = time.perf_counter() - started
        counts = tuple(count.blocks for count in index.train_counts)
        order = EpochOrder.make(counts, global_batch, 0, seed=0, shuffle=True)
        feeder = start_feeder(f"bench-corpus-{root.name}", StreamSpec(tuple(units), order, packing))
        started, cpu = time.perf_counter(), ray_workers_cpu()
        asked = []
        for step in range(order.steps):
            asked += [feeder.take.remote(0, step, rank, 2, 1) for rank in range(2)]
            if len(asked) >= 8:
                ray.get(asked[:2])
                asked = asked[2:]
        ray.get(asked)
        streamed, used = time.perf_counter() - started, ray_workers_cpu() - cpu
        stop_feeders()
    tokens, delivered = sum(count.tokens for count in index.train_counts), order.used * packing.length
    return {"index": tokens / counted, "ray": delivered / streamed, "ray_cpu": delivered / used,
            "peak_mb": memory.peak / 2**20}  # fmt: skip


def stall(shards: list[str], steps: int, out: Path) -> float:
    """Input time over input and productive time of ``raytpu train`` fed from the JSON-lines shards."""
    jsonl = [path for path in shards if path.endswith(".jsonl")]
    command = [str(Path(sys.executable).parent / "raytpu"), "train", str(CONFIG), "--train_file", ",".join(jsonl),
               "data.loader=ray", f"data.path={out / 'prepared'}", f"run.storage_path={out / 'runs'}",
               f"loop.max_steps={steps}", "loop.eval_every_steps=0", "checkpoint.every_steps=0",
               "data.max_eval_samples=64", "logging.progress_bar=false",
               "--validation_split_percentage", "1"]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    summary = json.loads((out / "runs" / "causal_lm-small" / "summary.json").read_text())
    categories = summary["goodput"]["categories"]
    return categories["input"] / (categories["input"] + categories["productive"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="megabytes of text in the corpus")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=120, help="steps of the training run whose stall is measured")
    parser.add_argument("--skip-train", action="store_true", help="leave out the training run")
    args = parser.parse_args()

    import ray

    with tempfile.TemporaryDirectory(prefix="raytpu-bench-corpus-") as tmp:
        work = Path(tmp)
        print(f"machine: {os.cpu_count()} CPUs; corpus {args.mb:g} MB and {args.mb / 4:g} MB", flush=True)
        big = make_corpus(work / "big", args.mb)
        small = make_corpus(work / "small", args.mb / 4)
        encoder = encoder_for(big, work / "tokenizer")
        packing = Packing(encoder, args.seq_len)
        units = find_units(big, "data.train_files")
        single, single_cpu = single_process(units, packing)
        print(f"single_tokens_per_s={single:,.0f} (1 process; {single_cpu:,.0f} per CPU second)", flush=True)
        together = side_by_side(units, packing, os.cpu_count() or 1)
        print(f"side_by_side_tokens_per_s={together:,.0f} ({os.cpu_count()} plain processes, no Ray)", flush=True)
        ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}})
        cores = int(ray.cluster_resources()["CPU"])
        quarter = ray_path(find_units(small, "data.train_files"), packing, work / "index-small", args.global_batch)
        whole = ray_path(units, packing, work / "index-big", args.global_batch)
        ray.shutdown()
        print(f"index_tokens_per_s={whole['index']:,.0f} ({cores} cores)")
        print(f"ray_tokens_per_s={whole['ray']:,.0f} ({cores} cores, delivered to 2 consumers; "
              f"{whole['ray_cpu']:,.0f} per CPU second of Ray's workers)")  # fmt: skip
        print(f"driver_peak_mb {args.mb / 4:g}MB={quarter['peak_mb']:.0f} {args.mb:g}MB={whole['peak_mb']:.0f}")
        print(f"wall_per_core_ratio={whole['ray'] / cores / single:.3f} (every core of the machine counted)")
        print(f"per_core_ratio={whole['ray_cpu'] / single_cpu:.3f} (per CPU second used; target >= 0.8)")
        print(f"side_by_side_ratio={whole['ray'] / together:.3f} (Ray against as many plain processes)", flush=True)
        if not args.skip_train:
            print(f"stall={stall(big, args.steps, work):.4f} (target < 0.02)")


if __name__ == "__main__":
    main()
