"""Host memory of loading a pretrained model under FSDP2, per worker, at 1, 2 and 4 workers.

A pretrained Llama (``--hidden``/``--layers``: 1,024 x 12 by default, 0.3 G parameters, 1.2 GB of
fp32 weights) is written once as a ``save_pretrained`` folder; then, for each worker count, that
many processes (``torchrun``, gloo) each build the causal LM job's model from it
(``job.model_name_or_path``) and shard it as a run does (``Runtime.build`` then ``prepare_model``,
``--fsdp full_shard``): each worker reads its own rows of every weight from the files
(``raytpu.parallel.reading``). They report their peak resident memory (``VmHWM``) once sharded, and
the peak of their anonymous memory (``RssAnon``, sampled every 5 ms): a process's resident memory
also counts the pages of the safetensors file it maps, which the page cache holds once for all the
processes of a machine and can give back. Side by side, in the same run: rank 0 loading the whole
model and sending each unit as it is sharded (``--rank-0-loads``: where the files cannot be read
shard by shard, Accelerate's ``cpu_ram_efficient_loading``), and every rank loading the whole model
(``--every-rank-loads``). Each figure is the peak less the process's figure before the build (its
imports), so that it is what loading took.

    python bench/pretrained_memory.py [--hidden 1024] [--layers 12]

The last line: ``max_over_one_at_4=<the largest worker's figure at 4 workers / the one worker's>
mean_over_one_at_4=<their mean / the one worker's>``, of the resident and then (``anon_``) of the
anonymous memory, for the shard-by-shard reading.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def resident_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return float("nan")


class AnonymousPeak:
    """The largest ``RssAnon`` seen by a thread that samples it every 5 ms, less its first reading."""

    def __init__(self) -> None:
        self.start, self.peak = resident_mb("RssAnon"), 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, resident_mb("RssAnon"))

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return max(self.peak, resident_mb("RssAnon")) - self.start


#: how the workers get their weights -> its flag
WAYS = {"each reads its shards": "", "rank 0 loads": "--rank-0-loads", "every rank loads": "--every-rank-loads"}


def worker(folder: str, way: str) -> None:
    """One rank: build and shard the pretrained model as a run does; print its memory as JSON."""
    import torch.distributed as dist

    from raytpu.config import load_config
    from raytpu.config.plan import resolve_config
    from raytpu.job import WEIGHT_FILES
    from raytpu.runtime import make_runtime

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    cfg, job = load_config(
        ROOT / "jobs" / "causal_lm" / "small.yaml",
        [f"job.model_name_or_path={folder}", "--fsdp", "full_shard", f"scaling.num_workers={world}", "job.seq_len=64"],
    )
    cfg = resolve_config(cfg, "cpu", "fp32")
    runtime = make_runtime("cpu", "fp32", world, rank, rank, sharding=cfg.sharding)
    before, anonymous = resident_mb("VmRSS"), AnonymousPeak()
    if way == "--every-rank-loads":
        model = job.build_model(cfg)
    elif way == "--rank-0-loads":  # the files not offered for reading: rank 0 loads, and sends
        model = runtime.build(lambda: unoffered(WEIGHT_FILES, job.build_model(cfg)))
    else:
        model = runtime.build(lambda: job.build_model(cfg))
    runtime.prepare_model(model)
    dist.barrier()
    peaks = {"peak_mb": resident_mb("VmHWM") - before, "anon_peak_mb": anonymous.stop()}
    print(json.dumps({"rank": rank, **peaks}), flush=True)
    dist.destroy_process_group()


def unoffered(offers: dict, model: object) -> object:
    offers.pop(model, None)
    return model


def write_model(folder: Path, hidden: int, layers: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=128, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def measure(folder: Path, workers: int, way: str) -> list[dict]:
    command = [str(BIN / "torchrun"), "--nproc_per_node", str(workers), __file__, "--worker", str(folder)]
    command += [way] if way else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "USE_TORCH_XLA": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    found = sorted((json.loads(r) for r in re.findall(r"\{[^{}]*\}", done.stdout)), key=lambda r: r["rank"])
    return found  # ranks' lines may share a line of torchrun's output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--worker", default="")
    parser.add_argument("--every-rank-loads", dest="way", action="store_const", const="--every-rank-loads")
    parser.add_argument("--rank-0-loads", dest="way", action="store_const", const="--rank-0-loads")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.way or "")
        return
    with tempfile.TemporaryDirectory(prefix="bench-pretrained-") as scratch:
        compare(Path(scratch) / "model", args.hidden, args.layers)


def compare(folder: Path, hidden: int, layers: int) -> None:
    parameters = write_model(folder, hidden, layers)
    print(f"a pretrained Llama of {parameters / 1e6:.0f} M parameters ({parameters * 4 / 2**20:.0f} MB in fp32)")
    found = {}
    for how, way in WAYS.items():
        for workers in (1, 2, 4):
            found[(way, workers)] = ranks = measure(folder, workers, way)
            resident = [round(rank["peak_mb"]) for rank in ranks]
            anonymous = [round(rank["anon_peak_mb"]) for rank in ranks]
            print(f"{how:>21}, {workers} worker(s): peak MB per worker {resident}, of anonymous memory {anonymous}")
    words = []
    for prefix, key in (("", "peak_mb"), ("anon_", "anon_peak_mb")):
        one = found[("", 1)][0][key]
        at_four = [rank[key] for rank in found[("", 4)]]
        words += [f"{prefix}max_over_one_at_4={max(at_four) / one:.3f}"]
        words += [f"{prefix}mean_over_one_at_4={sum(at_four) / len(at_four) / one:.3f}"]
    print(" ".join(words))


if __name__ == "__main__":
    main()
