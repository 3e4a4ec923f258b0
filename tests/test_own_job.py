"""The "Write your own job" page: its complete example (``examples/classifier.py``, shown verbatim
in docs/jobs.md) plugs in without touching the library, and trains with ``--local`` and on Ray."""

from __future__ import annotations

import json

import pytest

from raytpu import cli
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "classifier.py"


def test_the_page_shows_the_example_file_verbatim():
    page = (ROOT / "docs" / "jobs.md").read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in page


@pytest.mark.integration
@pytest.mark.parametrize("where", ["--local", "ray"])
def test_the_example_job_trains_and_learns(ray_session, tmp_path, capfd, where):
    """The documented commands with the example config (its data made on the fly), then its test."""
    common = [f"data.path={tmp_path / 'data'}", f"run.storage_path={tmp_path}", "logging.progress_bar=false"]
    extra = ["--local"] if where == "--local" else []
    assert cli.main(["train", "examples/classifier.yaml", *common, *extra]) == 0
    out = capfd.readouterr().out
    final = json.loads(out.split("final metrics:")[1].splitlines()[0])
    assert final["valid/accuracy"] > 0.8, out[-2000:]  # chance: 0.5
    best = out.split("best checkpoint:")[1].split()[0]
    if where == "ray":
        assert cli.main(["test", "examples/classifier.yaml", "--checkpoint", best, *common]) == 0
        tested = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
        assert tested["test/accuracy"] > 0.8
