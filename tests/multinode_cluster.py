"""One Ray cluster of several nodes on this machine for every multi-node scenario of the suite:
``python -m tests.multinode_cluster OUT``, run by ``tests/test_multinode.py`` in a PID namespace of
its own (``unshare -fp --mount-proc``), so that what this cluster starts ends with it and never
touches the test session's Ray; with the session's S3 server's endpoint and keys in the
environment, which every node reads, as a cloud VM reads its own.

The cluster (``ray.cluster_utils.Cluster``): a head with no CPU for workers (its dashboard on: Ray
Train's state API) and two worker nodes of one CPU each, each with a temporary folder of its own
(``TMPDIR``). The scenarios run one after the other, each in a folder of its own, each adding the
nodes it needs and removing them after; the one that removes the cluster's own nodes comes last:

1. ``bucket`` (``tests/bucket_cluster.py``): MSHNet small in S3, a worker killed, resumed;
2. ``corpus`` (``tests/corpus_cluster.py``): the causal LM streamed from S3 (a third node added);
3. ``fake_tpu`` (``tests/fake_tpu_cluster.py``): two fake v4-16 slices added, one taken away;
4. ``elastic`` (``tests/elastic_cluster.py``): nodes removed and added under elastic runs.

Prints one JSON line: each scenario's report, or the traceback that ended it (the next one runs all
the same, so that one failing scenario fails its own tests only).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests import bucket_cluster, corpus_cluster, elastic_cluster, fake_tpu_cluster

#: name -> scenario(cluster, its folder, the worker nodes' temporary folders), in the order they run
SCENARIOS: dict[str, Callable[[Any, Path, list[Path]], dict[str, Any]]] = {
    "bucket": bucket_cluster.scenario,
    "corpus": corpus_cluster.scenario,
    "fake_tpu": fake_tpu_cluster.scenario,
    "elastic": elastic_cluster.scenario,  # removes the cluster's nodes: last
}


@contextlib.contextmanager
def inside(folder: Path):
    """The scenario's folder as the working directory (a relative path a run wrongly makes lands there)."""
    folder.mkdir(parents=True)
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield folder
    finally:
        os.chdir(before)


def main(out: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    os.environ.pop("RAY_ADDRESS", None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    node_tmp = [out / "node1-tmp", out / "node2-tmp"]
    report: dict[str, Any] = {}
    try:
        for folder in node_tmp:
            folder.mkdir()
            cluster.add_node(num_cpus=1, env_vars={"TMPDIR": str(folder)})
        cluster.wait_for_nodes()
        os.environ["RAY_ADDRESS"] = cluster.address
        for name, scenario in SCENARIOS.items():
            started = time.monotonic()
            try:
                with inside(out / name) as folder:
                    report[name] = scenario(cluster, folder, node_tmp)
            except Exception:
                report[name] = {"error": traceback.format_exc()[-6000:]}
            report[name]["scenario_s"] = time.monotonic() - started
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
