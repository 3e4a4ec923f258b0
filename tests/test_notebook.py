"""The shipped notebook (``examples/quickstart.ipynb``) in a real Jupyter kernel (nbclient): MSHNet
on 2 local Ray workers drawn as one notebook progress bar, a kernel interrupt that checkpoints the
run and returns, the same cell resuming it, and a second ``raytpu.train`` of a job written in a cell,
all on the one local Ray instance the first call started and kept; then the notebook page's own
cells (docs/notebook.md) in the same kernel, the last of which stops that instance."""

from __future__ import annotations

import ast
import asyncio
import os
import threading
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from raytpu.cluster.connect import KEPT_LINE
from tests.conftest import ROOT
from tests.task_pages import cells, is_install_cell, sandbox

NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
WIDGET = "application/vnd.jupyter.widget-view+json"


def text_of(cell) -> str:
    """A cell's printed output (stdout and stderr) and error, as one text."""
    parts = [output.get("text", "") for output in cell.outputs if output.output_type == "stream"]
    parts += [output.get("evalue", "") for output in cell.outputs if output.output_type == "error"]
    return "".join(parts)


def interrupt_at_first_checkpoint(client: NotebookClient, run_dir: Path, deadline_s: float) -> threading.Thread:
    """A thread that interrupts the kernel once the run has written a checkpoint."""

    def watch() -> None:
        ends = time.monotonic() + deadline_s
        while time.monotonic() < ends and not any(run_dir.glob("checkpoint_*/model.safetensors")):
            time.sleep(0.5)
        asyncio.run(client.km.interrupt_kernel())  # as Jupyter's interrupt button does

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def ray_address(client: NotebookClient) -> str:
    """The Ray instance the kernel's calls use, read in a cell of the test's own."""
    cell = nbformat.v4.new_code_cell("import os; os.environ.get('RAY_ADDRESS')")
    client.execute_cell(cell, 0)
    return cell.outputs[-1]["data"]["text/plain"]


@pytest.mark.integration
def test_the_notebook_trains_is_interrupted_resumes_and_trains_a_job_of_its_own(tmp_path):
    """A kernel with no cluster to join, as a notebook on a laptop: the first ``raytpu.train`` starts
    a local Ray instance, says once that it is kept, and every later call of the kernel uses it."""
    work = tmp_path / "examples"
    work.mkdir()
    (tmp_path / "jobs").symlink_to(ROOT / "jobs")  # the notebook names ../jobs/mshnet/small.yaml
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    imports, train, read, own_job = code
    client = NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    with client.setup_kernel(env=env):
        client.execute_cell(imports, notebook.cells.index(imports))
        watcher = interrupt_at_first_checkpoint(client, work / "results" / "mshnet-notebook", deadline_s=600)
        client.execute_cell(train, notebook.cells.index(train))
        watcher.join()
        stopped = text_of(train)
        assert "SIGINT received" in stopped and "stopped by SIGINT after checkpointing step" in stopped, stopped
        assert "Traceback" not in stopped
        assert stopped.count(KEPT_LINE) == 1, stopped
        kept = ray_address(client)

        client.execute_cell(train, notebook.cells.index(train))  # the same cell again: resumed
        resumed = text_of(train)
        assert "resumed from" in resumed, resumed
        bars = [output for output in train.outputs if WIDGET in output.get("data", {})]
        assert len(bars) == 1, train.outputs  # one bar, drawn by the driver
        assert "train:" not in resumed  # rank 0 drew none of its own in the forwarded lines
        assert "final metrics:" in resumed

        client.execute_cell(read, notebook.cells.index(read))
        shown = read.outputs[-1]["data"]["text/plain"]
        assert "valid/mIoU" in shown, read.outputs

        client.execute_cell(own_job, notebook.cells.index(own_job))
        best = ast.literal_eval(own_job.outputs[-1]["data"]["text/plain"])  # the cell's value: best_metrics
        assert best["valid/accuracy"] > 0.9, text_of(own_job)  # chance: 0.5
        assert KEPT_LINE not in resumed + text_of(own_job) and ray_address(client) == kept
        page_cells(client, sandbox(tmp_path / "clone"))


def page_cells(client: NotebookClient, folder: Path) -> None:
    """The notebook page's cells (docs/notebook.md), in a notebook in a clone's root as the page
    says, with the one-minute override it names; the Ray instance the kernel kept, then stopped."""
    chdir = nbformat.v4.new_code_cell(f"import os; os.chdir({str(folder)!r})")
    client.execute_cell(chdir, 0)
    train, read, test, stop = [nbformat.v4.new_code_cell(c) for c in cells("notebook.md") if not is_install_cell(c)]
    assert train.source.count('"run.name=mshnet-notebook")') == 1, train.source
    train.source = train.source.replace(
        '"run.name=mshnet-notebook")', '"run.name=mshnet-notebook", "loop.max_steps=40")'
    )
    for index, cell in enumerate((train, read, test, stop)):
        client.execute_cell(cell, index)
        assert not [out for out in cell.outputs if out.output_type == "error"], text_of(cell)
    assert "starting a local Ray instance" not in text_of(train), text_of(train)  # the kept one
    assert str(folder / "results" / "mshnet-notebook") in text_of(read)
    assert "test/mIoU" in test.outputs[-1]["data"]["text/plain"], test.outputs
    after = nbformat.v4.new_code_cell("ray.is_initialized()")
    client.execute_cell(after, 0)
    assert after.outputs[-1]["data"]["text/plain"] == "False"
