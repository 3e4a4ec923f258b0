"""CLI errors (one line, non-zero exit, before any Ray start) and the runtime/precision policy."""

from __future__ import annotations

import sys

import pytest

from raytpu import cli
from raytpu.config import ConfigError
from raytpu.runtime import resolve_precision
from raytpu.runtime.placement import ClusterOffer, choose_runtime
from tests.conftest import ROOT

SMALL = str(ROOT / "jobs/mshnet/small.yaml")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", SMALL, "optim.lrr=1"], "unknown config key 'optim.lrr'; did you mean optim.lr"),
        (["train", SMALL, "--batch-size", "7"], "not divisible by 2 data-parallel workers"),
        (
            ["train", SMALL, "data.path=/nowhere", "data.synthesize_if_missing=false"],
            "data.path '/nowhere' does not exist: give the data set's folder",
        ),
        (["train", "nope.yaml"], "config file 'nope.yaml' not found"),
        (["test", SMALL], "test mode needs weights"),
        (["test", SMALL, "--checkpoint", "/no/ckpt"], "checkpoint '/no/ckpt' not found"),
        (["data", "synth", "nosuchjob", "--out", "x"], "unknown job 'nosuchjob'"),
        (["data", "synth", "mshnet", "--out", "x", "--count", "3"], "unknown option --count; this job accepts --n"),
    ],
)
def test_user_errors_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./data/<job> fallback from the repository
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("raytpu: error: ") and "\n" not in err
    assert message in err, err


def test_data_synth_writes_the_layout(tmp_path, capsys):
    assert cli.main(["data", "synth", "mshnet", "--out", str(tmp_path), "--n", "5", "--size", "32"]) == 0
    assert len(list((tmp_path / "images").glob("*.png"))) == 5


@pytest.mark.parametrize(
    ("tpu", "gpu", "expected"), [(True, True, "xla"), (False, True, "cuda"), (False, False, "cpu")]
)
def test_auto_runtime(tpu, gpu, expected):
    machine = {"CPU": 8.0, "TPU": 8.0 * tpu, "GPU": 1.0 * gpu}
    offer = ClusterOffer(nodes=(machine,), available=machine, this_machine=True)
    assert choose_runtime("auto", offer)[0] == expected
    assert choose_runtime("cpu", offer) == ("cpu", "")


@pytest.mark.parametrize(
    ("runtime", "asked", "bf16_ok", "expected", "warns"),
    [
        ("xla", "auto", True, "bf16", False),
        ("cuda", "auto", True, "bf16", False),
        ("cuda", "auto", False, "fp16", False),
        ("cpu", "auto", True, "fp32", False),
        ("xla", "fp16", True, "bf16", True),
        ("cpu", "fp16", True, "fp32", True),
        ("cuda", "bf16", False, "fp16", True),
        ("cuda", "bf16", True, "bf16", False),
        ("xla", "fp32", True, "fp32", False),
    ],
)
def test_precision_follows_the_device(runtime, asked, bf16_ok, expected, warns):
    precision, warning = resolve_precision(runtime, asked, bf16_ok)
    assert precision == expected
    assert (warning is not None) == warns


def test_relative_weights_path_reaches_workers_absolute(tmp_path, monkeypatch):
    """Relative paths are the driver's: absolute in the plan, and in a plan remade elsewhere (a
    Tune trial, another size) from another working folder."""
    from raytpu.config import load_config
    from raytpu.config.plan import Facts, make_plan

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    cfg, _ = load_config(SMALL, ["checkpoint.weights=ckpt"])
    plan = make_plan(cfg, Facts(mode="train"))
    monkeypatch.chdir(ROOT)
    for made in (plan, plan.remade({"optim.lr": 0.5})):
        assert made.config.checkpoint.weights == str(tmp_path / "ckpt")
        assert made.config.run.storage_path == str(tmp_path / "results")
    trial = plan.remade({"run.storage_path": str(tmp_path / "sweep/runs")})  # a value given wins
    assert trial.config.run.storage_path == str(tmp_path / "sweep/runs")


def test_a_missing_data_path_is_made_there_refused_when_typed_or_falls_back(tmp_path, monkeypatch, capsys):
    """data.path missing: with synthesize_if_missing the set is made at that path (for this run's
    seed), even when ./data/<job> holds another set; a path typed on the command line is one error
    (never another folder); the config's own path falls back to ./data/<job>, said in a note."""
    from raytpu.config.loading import read_config
    from raytpu.driver.preflight import resolve_data_root

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "tests.toy_job").mkdir(parents=True)
    config = tmp_path / "toy.yaml"
    config.write_text(f"job: {{name: tests.toy_job}}\ndata: {{path: {tmp_path / 'configured'}}}\n")
    cfg, job, origins = read_config(config, [f"data.path={tmp_path / 'mine'}", "data.synthesize_if_missing=true"])
    with origins.naming_sources():
        assert resolve_data_root(cfg, job) == tmp_path / "mine" and (tmp_path / "mine" / "READY").is_file()
    for typed in ([f"data.path={tmp_path / 'absent'}"], ["--data-path", str(tmp_path / "absent")]):
        cfg, job, origins = read_config(config, [*typed, "data.synthesize_if_missing=false"])
        missing = f"data.path '{tmp_path / 'absent'}' does not exist"
        with pytest.raises(ConfigError, match=missing), origins.naming_sources():
            resolve_data_root(cfg, job)
    cfg, job, origins = read_config(config)
    with origins.naming_sources():
        assert resolve_data_root(cfg, job) == tmp_path / "data" / "tests.toy_job"
    assert "raytpu: note: data.path" in capsys.readouterr().out


OWN_JOB = """
from dataclasses import dataclass

from raytpu.job import JobConfig
from tests.toy_job import JOB as TOY


@dataclass{frozen}
class MyConfig(JobConfig):
    name: str = "my_job"


class MyJob(type(TOY)):
    name, config_class = "my_job", MyConfig


JOB = MyJob()
"""


def own_job(folder, frozen: bool) -> str:
    (folder / "my_job.py").write_text(OWN_JOB.replace("{frozen}", "(frozen=True)" if frozen else ""))
    (folder / "my.yaml").write_text("job: {name: my_job}\ndata: {synthesize_if_missing: true}\n")
    return str(folder / "my.yaml")


def test_a_plain_dataclass_job_config_is_one_line_saying_how_to_declare_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_job", raising=False)
    code = cli.main(["train", own_job(tmp_path, frozen=False), "--local"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("raytpu: error: ") and "\n" not in err, err
    assert "my_job.py:8: cannot inherit non-frozen dataclass from a frozen one" in err
    assert "@dataclass(frozen=True)" in err


def test_an_undotted_name_finds_ones_own_module_or_says_how_to_name_it(tmp_path, monkeypatch):
    from raytpu.job import load_job

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_job", raising=False)
    own_job(tmp_path, frozen=True)
    assert load_job("my_job").name == "my_job"
    assert load_job("mshnet").name == "mshnet"  # a shipped job keeps its short name
    with pytest.raises(ValueError, match=r"name a job of your own by its module path .*\(my_jb for ./my_jb.py"):
        load_job("my_jb")
