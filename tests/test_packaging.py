"""What ``pip install`` puts into site-packages, and what raytpu needs of it: the shipped jobs
install as ``raytpu.jobs`` (no generic top-level ``jobs``), their own dependencies are extras,
and the library and its command line run with only the core dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import tomllib

from tests.conftest import ROOT

#: the jobs' own dependencies (``raytpu[mshnet]``, ``[cdeit]``, ``[lm]``): absent in a core install
JOB_DEPENDENCIES = ["skimage", "pyeit", "transformers", "tokenizers", "PIL", "scipy"]

#: run before the code under test: every job dependency fails to import, as in a core install
BLOCK = f"""
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {JOB_DEPENDENCIES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
"""


def core_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_package_list_names_every_package_of_raytpu_and_jobs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    assert project["package-dir"] == {"raytpu.jobs": "jobs"}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "raytpu").rglob("__init__.py")}
    found |= {"raytpu." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jobs").rglob("__init__.py")}
    assert listed == found


def test_torch_is_pinned_only_where_torch_xla_needs_it():
    """The core takes the torch the user has (2.9 or newer); the xla and tpu extras pin the one
    torch torch_xla 2.9.0 is built against, the torch_tpu extra the range TorchTPU 0.2.0 needs; the
    core's other dependencies are ranges."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {
        requirement.split("[")[0].split(">")[0].split("=")[0]: requirement for requirement in project["dependencies"]
    }
    assert core["torch"] == "torch>=2.9" and not any("==" in requirement for requirement in core.values())
    for extra in ("xla", "tpu"):
        assert "torch==2.9.0" in project["optional-dependencies"][extra]
    torch_tpu = project["optional-dependencies"]["torch_tpu"]  # its own torch, and never torch_xla
    assert "torch>=2.11,<=2.15" in torch_tpu and not any("torch_xla" in requirement for requirement in torch_tpu)


def test_the_wheel_installs_one_top_level_package_with_the_jobs_and_their_configs(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("raytpu-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"raytpu", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "raytpu/jobs/mshnet/model.py" in names and "raytpu/jobs/mshnet/small.yaml" in names
    assert "raytpu/jobs/causal_lm/llama3-8b.yaml" in names


def test_raytpu_and_its_help_need_only_the_core_dependencies():
    done = core_python(
        "import raytpu, raytpu.cli, raytpu.config, raytpu.driver.commands, raytpu.worker.loop\n"
        "try:\n    raytpu.cli.main(['--help'])\nexcept SystemExit as exit_:\n    print('exit', exit_.code)\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raytpu" in done.stdout and "exit 0" in done.stdout


def test_a_job_whose_extra_is_missing_is_one_line_naming_it():
    done = core_python("import sys, raytpu.cli; sys.exit(raytpu.cli.main(['train', 'jobs/mshnet/small.yaml']))")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "raytpu: error: job 'mshnet' needs the package 'skimage', which is not installed: "
        f"pip install -e '{ROOT}[mshnet]'"
    )  # raytpu runs from its clone here: the extra is installed from there
    done = core_python("import sys, raytpu.cli; sys.exit(raytpu.cli.main(['train', 'jobs/causal_lm/small.yaml']))")
    assert done.returncode == 2 and f"pip install -e '{ROOT}[lm]'" in done.stderr, done.stderr[-2000:]


def test_the_mlflow_extra_alone_opens_the_default_store(tmp_path):
    """``pip install -e '.[mlflow]'`` then ``--report_to mlflow`` without a server: the extra's own
    packages (mlflow-skinny, no server, no Flask), in a fresh environment, open the default store
    (an SQLite file beside the runs: ``raytpu.config.plan.default_tracking_uri``) through raytpu's
    tracker and read the run back."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["mlflow"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", *extra, "pyarrow>=15"]  # pyarrow: the core's, for the run folder
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    store, folder = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "run"
    script = f"""
import importlib.util, json, types
from raytpu.records.trackers import open_trackers
from raytpu.storage.run_folder import RunFolder
assert importlib.util.find_spec("flask") is None, "the whole of mlflow is installed"
log = types.SimpleNamespace(report_to=["mlflow"], experiment="extra", mlflow_tracking_uri={store!r},
                            mlflow_parent_run="", wandb_mode="", wandb_group="")
trackers = open_trackers(log, RunFolder({str(folder)!r}), "run", False, print)
trackers.params({{"optim.lr": 0.1}})
trackers.scalars({{"train/loss": 1.5}}, 1)
trackers.close(True)
from mlflow.tracking import MlflowClient
run = MlflowClient({store!r}).get_run(json.load(open({str(folder / "trackers.json")!r}))["mlflow"]["run_id"])
print(json.dumps([run.info.status, run.data.metrics, run.data.params]))
"""
    done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["FINISHED", {"train/loss": 1.5}, {"optim.lr": "0.1"}]
