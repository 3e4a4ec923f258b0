"""Start-up, side by side in one run: how long a run takes from its command (or call) to its first
training step, by goodput's record of the run (``start-up: driver, worker set-up, build, ...``).

* ``api 1st`` and ``api 2nd``: two ``raytpu.train`` calls in one Python process, as a notebook makes
  them (the first starts a local Ray instance, the second finds it kept);
* ``cli``: ``raytpu train`` (a local Ray instance of its own);
* ``--local``: ``raytpu train --local`` (local processes, no Ray);
* ``quick start``: the quick start's command, ``raytpu train jobs/mshnet/small.yaml``, cut to one step;
* ``torchrun`` beside ``--local mshnet``: the same step of MSHNet by a bare script under
  ``torchrun --nproc_per_node 2`` (``bench/bare_step.py``: no evaluation, no checkpoint) and by
  ``raytpu train --local``, whole processes (``local_over_torchrun``);
* ``--local gpu``: where a GPU is at hand, ``raytpu train --local`` of the causal LM on one GPU.

The first four train ``examples/classifier.yaml`` (a two-layer MLP: start-up is all there is) for
one step. Each figure is the median of ``--repeats`` (the kinds alternating), with the command's
whole wall time beside it. The last line::

    second_call_startup_s=<api 2nd> quickstart_startup_s=<quick start> cli_over_second=<cli / api 2nd>
    local_over_torchrun=<--local mshnet / torchrun, whole processes>

    python bench/startup.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CLASSIFIER = ["examples/classifier.yaml", "loop.max_steps=1", "logging.progress_bar=false"]
#: two raytpu.train calls in one process; prints each run's folder
TWO_CALLS = """
import json, sys, raytpu
folders = [raytpu.train(*sys.argv[1:], f"run.name=api-{i}").run_dir for i in range(2)]
print("RUNS " + json.dumps(folders))
"""


def startup_of(run_dir: Path) -> float:
    """From the command's start to its first step, by its goodput record."""
    from raytpu.records import goodput
    from raytpu.storage.run_folder import RunFolder

    record = json.loads(RunFolder(run_dir).read_text(goodput.RECORD) or "{}")
    return sum(goodput.startup_parts(record["commands"][-1]).values())


def run(command: list[str]) -> tuple[str, float]:
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done.stdout, time.monotonic() - start


def measure(work: Path, repeat: int, gpu: bool) -> dict[str, tuple[float, float]]:
    """Each kind's (start-up, whole wall time) for one repeat."""
    where = [f"run.storage_path={work / f'runs-{repeat}'}", f"data.path={work / 'classifier'}"]
    found: dict[str, tuple[float, float]] = {}
    out, wall = run([sys.executable, "-c", TWO_CALLS, *CLASSIFIER, *where])
    folders = json.loads(next(line for line in out.splitlines() if line.startswith("RUNS "))[5:])
    found["api 1st"] = (startup_of(Path(folders[0])), wall)
    found["api 2nd"] = (startup_of(Path(folders[1])), wall)
    for kind, extra in (("cli", []), ("--local", ["--local"])):
        name = kind.strip("-")
        _, wall = run([str(BIN / "raytpu"), "train", *CLASSIFIER, *where, f"run.name={name}", *extra])
        found[kind] = (startup_of(work / f"runs-{repeat}" / name), wall)
    quick = ["jobs/mshnet/small.yaml", "loop.max_steps=1", "logging.progress_bar=false", "run.name=quick"]
    _, wall = run([str(BIN / "raytpu"), "train", *quick, where[0], f"data.path={work / 'mshnet'}"])
    found["quick start"] = (startup_of(work / f"runs-{repeat}" / "quick"), wall)
    _, bare = run([str(BIN / "torchrun"), "--nproc_per_node", "2", "bench/bare_step.py", str(work / "mshnet")])
    found["torchrun"] = (float("nan"), bare)
    _, wall = run([str(BIN / "raytpu"), "train", "--local", *quick[:3], "run.name=local-mshnet", where[0],
                   f"data.path={work / 'mshnet'}"])  # fmt: skip
    found["--local mshnet"] = (startup_of(work / f"runs-{repeat}" / "local-mshnet"), wall)
    if gpu:
        lm = ["jobs/causal_lm/small.yaml", "--local", "scaling.num_workers=1", "loop.max_steps=1", "run.name=gpu"]
        _, wall = run([str(BIN / "raytpu"), "train", *lm, where[0], "logging.progress_bar=false"])
        found["--local gpu"] = (startup_of(work / f"runs-{repeat}" / "gpu"), wall)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    runs = []
    for repeat in range(args.repeats):
        runs.append(measure(work, repeat, gpu))
        print(f"repeat {repeat}: " + ", ".join(f"{k} {s:.1f} s" for k, (s, _) in runs[-1].items()), flush=True)
    print(f"{'':>14}  start-up (to the first step)  whole command")
    medians, walls = {}, {}
    for kind in runs[0]:
        medians[kind] = statistics.median(r[kind][0] for r in runs)
        walls[kind] = statistics.median(r[kind][1] for r in runs)
        print(f"{kind:>14}  {medians[kind]:7.1f} s{'':20}{walls[kind]:7.1f} s")
    print("(api 1st and api 2nd share one process: its whole time is both calls')")
    print(
        f"second_call_startup_s={medians['api 2nd']:.1f} quickstart_startup_s={medians['quick start']:.1f} "
        f"cli_over_second={medians['cli'] / medians['api 2nd']:.2f}"
    )
    print(f"local_over_torchrun={walls['--local mshnet'] / walls['torchrun']:.3f}")


if __name__ == "__main__":
    main()
