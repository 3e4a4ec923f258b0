"""What a change of capacity costs an elastic run, beside a fixed-size run's restart, on one cluster.

A Ray cluster of a head and two one-CPU nodes on this machine (``tests/elastic_cluster.py``), the
toy job (8 steps an epoch, a checkpoint every 4 steps), side by side in one run:

* **elastic, node lost**: ``scaling.num_workers=1:2``, a node removed after the first checkpoint:
  the seconds from the loss to the next training step (on one worker), and the steps run again
  (those after the last checkpoint);
* **elastic, capacity added**: a node added back: the seconds from the group's stop at its next
  checkpoint to the next step (on two workers), and the steps run again (none: it stops at a
  checkpoint);
* **fixed, worker killed**: ``scaling.num_workers=2`` with one failure allowed, a worker's process
  killed after the first checkpoint: Ray Train's restart at the same size.

The last line is ``ratio=<elastic loss-to-step / fixed restart-to-step>``. It starts Ray processes
of its own: run it where no other Ray runs, or in a PID namespace of its own:

    unshare -fp --mount-proc python bench/elastic.py
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.elastic_cluster import after, run_variant, seen_records, start_cluster  # noqa: E402


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="rtbe-", dir="/tmp"))
    atexit.register(shutil.rmtree, out, True)  # the benchmark keeps only what it prints
    cluster = start_cluster()
    try:
        elastic = run_variant(cluster, out, "ddp")
        fixed = run_variant(cluster, out, "fixed")
    finally:
        cluster.shutdown()
    for name, run in (("elastic", elastic), ("fixed", fixed)):
        if run["code"]:
            print(f"{name} run failed ({run['code']}):\n{run['output'][-3000:]}")
            sys.exit(1)
    records = seen_records(Path(elastic["seen"]))
    changes = json.loads((Path(elastic["run_dir"]) / "resizes.json").read_text())
    lost_s, redone = after(records, elastic["removed_at"])
    grown = next(change for change in changes if change["to"] > change["from"])
    grow_s, _ = after(records, grown["ended"])
    restart_s, fixed_redone = after(seen_records(Path(fixed["seen"])), fixed["killed_at"])
    print(f"elastic 1:2, node lost:      next step {lost_s:.1f} s after the loss; {redone} step(s) run again in all")
    print(f"elastic 1:2, capacity added: next step {grow_s:.1f} s after the group stopped at its checkpoint")
    print(f"fixed 2, worker killed:      next step {restart_s:.1f} s after the kill; {fixed_redone} step(s) run again")
    print(f"ratio={lost_s / restart_s:.2f}")


if __name__ == "__main__":
    main()
