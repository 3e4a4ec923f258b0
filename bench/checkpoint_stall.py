"""How long the training loop is blocked per checkpoint: a local run folder vs a bucket, side by side.

MSHNet small on 2 workers through Ray, a checkpoint every 10 steps (``checkpoint.every_steps=10``,
60 steps), once with ``run.storage_path`` a local folder and once an S3 bucket on a loopback S3
server (moto's, started here). Rank 0's ``checkpointing`` seconds in each run's ``goodput.json``
(the time between the loop handing over a checkpoint and getting on with training: writing the
files locally, the report, and a wait for the previous upload when one is still in flight) over
the checkpoints written. The last line is ``ratio=<bucket blocked s / local blocked s>`` (target
<= 1.5: the upload runs in the background). About 3 minutes on 2 cores.

    python bench/checkpoint_stall.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BIN = Path(sys.executable).parent
STEPS, EVERY = 60, 10

from tests.stores import BUCKET, S3_KEYS, make_s3_bucket  # noqa: E402 (the repo root, above)


def start_s3() -> dict[str, str]:
    """moto's S3 server on loopback, with the bucket; what a run needs in its environment to use it."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {**S3_KEYS, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://{host}:{port}"}
    make_s3_bucket(env["AWS_ENDPOINT_URL"], BUCKET)
    return env


def blocked_per_checkpoint(command: list[str], env: dict[str, str], goodput_file: Any) -> float:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    record = json.loads(goodput_file())
    return record["categories"]["checkpointing"] / (STEPS // EVERY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-stall-"))
    atexit.register(shutil.rmtree, work, True)  # the benchmark keeps only what it prints
    data = work / "mshnet"
    synth = [str(BIN / "raytpu"), "data", "synth", "mshnet", "--out", str(data), "--n", "200", "--size", "64"]
    subprocess.run(synth, cwd=ROOT, check=True, capture_output=True)
    env = start_s3()
    from raytpu.storage.run_folder import RunFolder

    common = ["jobs/mshnet/small.yaml", f"loop.max_steps={STEPS}", f"checkpoint.every_steps={EVERY}"]
    common += [f"data.path={data}", "logging.progress_bar=false", "checkpoint.num_to_keep=2"]
    places = {"local": str(work / "runs"), "bucket": f"s3://{BUCKET}/bench-stall"}
    blocked: dict[str, list[float]] = {name: [] for name in places}
    for repeat in range(args.repeats):
        for name, storage in places.items():
            run = f"{name}-{repeat}"
            command = [str(BIN / "raytpu"), "train", *common, f"run.storage_path={storage}", f"run.name={run}"]
            os.environ.update(env)  # this process reads the bucket's record too
            record = lambda storage=storage, run=run: RunFolder(f"{storage}/{run}").read_text("goodput.json")  # noqa: E731
            blocked[name].append(blocked_per_checkpoint(command, env, record))
            print(f"repeat {repeat} {name:>6}: {blocked[name][-1]:.3f} s blocked per checkpoint", flush=True)
    medians = {name: statistics.median(values) for name, values in blocked.items()}
    for name, value in medians.items():
        print(f"{name:>6}: {value:.3f} s blocked per checkpoint (median of {args.repeats}, {STEPS // EVERY} a run)")
    print(f"ratio={medians['bucket'] / medians['local']:.3f}")


if __name__ == "__main__":
    main()
