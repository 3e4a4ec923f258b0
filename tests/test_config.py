"""Config loading, overrides, seed-flag aliases and errors."""

from __future__ import annotations

import re

import pytest
import yaml

from raytpu.config import ConfigError, dump_yaml, from_dict, load_config, to_dict, with_values
from raytpu.config.args import extract, read_overrides
from raytpu.config.batching import BatchPlan
from raytpu.config.plan import Plan, ScriptPlan


def write(tmp_path, text: str):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_yaml_and_dotted_overrides(tmp_path):
    path = write(tmp_path, "job: {name: tests.toy_job, samples: 32}\noptim: {lr: 0.1}\nscaling: {num_workers: 2}\n")
    cfg, job = load_config(path, ["optim.lr=1e-4", "scaling.num_workers=4", "job.features=3", "runtime=xla"])
    assert job.name == "tests.toy_job"
    assert cfg.optim.lr == pytest.approx(1e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.scaling.num_workers == 4 and cfg.scaling.runtime == "xla"
    assert cfg.job.samples == 32 and cfg.job.features == 3


def test_seed_script_flags_are_aliases(tmp_path):
    path = write(tmp_path, "job: {name: tests.toy_job}\n")
    cfg, _ = load_config(path, ["--batch-size", "16", "--seed=3", "--data-path", "/x"])
    assert cfg.data.global_batch_size == 16 and cfg.run.seed == 3 and cfg.data.path == "/x"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lrr=0.1", "unknown config key 'optim.lrr'; did you mean optim.lr"),
        ("optimm.lr=0.1", "did you mean optim.lr"),
        ("loop.epochs=many", "loop.epochs must be a number"),
        ("scaling.runtime=tpu", "scaling.runtime='tpu' is not one of auto, cpu, cuda, xla"),
        ("data.shuffle=maybe", "data.shuffle must be true or false"),
        ("nonsense", "is not key=value"),
        ("data.prefetch_batches=-1", "data.prefetch_batches must be at least 0, got -1"),
    ],
)
def test_bad_overrides_name_the_fix(tmp_path, override, message):
    path = write(tmp_path, "job: {name: tests.toy_job}\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(path, [override])


def test_command_line_values_mean_what_was_typed(tmp_path):
    """A value typed on the command line is read by its field's type, never by YAML 1.1's rules
    (which read 0755 as octal 493, no as false, 1:30 as base-60 90)."""
    path = write(tmp_path, "job: {name: tests.toy_job}\n")
    cfg, _ = load_config(path, ["run.name=0755", "logging.experiment=no", "--learning_rate", "1e-4"])
    assert cfg.run.name == "0755" and cfg.logging.experiment == "no" and cfg.optim.lr == pytest.approx(1e-4)
    cfg, _ = load_config(path, ["--run_name", "on", "loop.epochs=0010", "data.shuffle=no", "optim.betas=[0.9, 0.95]"])
    assert cfg.run.name == "on" and cfg.loop.epochs == 10 and cfg.data.shuffle is False
    assert cfg.optim.betas == [0.9, 0.95]
    for typed, message in (
        ("optim.lr=1:30", "optim.lr must be a number (float), got '1:30'"),
        ("loop.epochs=0x1F", "loop.epochs must be a number (int), got '0x1F'"),
        ("loop.epochs=3.5", "loop.epochs must be a number (int), got '3.5'"),
        ("data.shuffle=off", "data.shuffle must be true or false, got 'off'"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path, [typed])


def test_config_files_are_read_by_yaml_1_2(tmp_path):
    """A file's 1e-4 is a number and 1:30 is text (YAML 1.2's core schema), as in most YAML tools."""
    path = write(tmp_path, "job: {name: tests.toy_job}\noptim: {lr: 1e-4}\nrun: {name: 1:30}\n")
    cfg, _ = load_config(path)
    assert cfg.optim.lr == pytest.approx(1e-4) and cfg.run.name == "1:30"
    assert from_dict(yaml.safe_load(dump_yaml(cfg)))[0].run.name == "1:30"


def test_unknown_key_in_file_and_unknown_flag(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'loop.epoch'; did you mean loop.epochs"):
        load_config(write(tmp_path, "job: {name: tests.toy_job}\nloop: {epoch: 3}\n"))
    with pytest.raises(ConfigError, match="unknown flag --batch-sise; did you mean --batch-size"):
        load_config(write(tmp_path, "job: {name: tests.toy_job}\n"), ["--batch-sise", "3"])


def test_unknown_job_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown job 'nosuchjob'"):
        load_config(write(tmp_path, "job: {name: nosuchjob}\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    cfg, _ = load_config(write(tmp_path, "job: {name: tests.toy_job}\n"), ["optim.lr=0.5"])
    again, _ = from_dict(yaml.safe_load(dump_yaml(cfg)))
    assert to_dict(again) == to_dict(cfg)


def test_the_batch_plan_splits_checks_and_steps_down():
    plan = BatchPlan(16, workers=2, grad_accum=2)
    assert (plan.per_worker, plan.per_device(2), plan.eval_per_worker) == (4, 2, 8)
    with pytest.raises(ConfigError, match="use a multiple of 4"):
        BatchPlan(10, 2, 2)
    with pytest.raises(ConfigError, match="not divisible by its 3 devices"):
        plan.per_device(3)
    assert plan.smaller(1) == BatchPlan(16, 2, 4) and BatchPlan(6, 2, 1).smaller(1) == BatchPlan(6, 2, 3)
    assert BatchPlan(4, 4, 1).smaller(1) is None
    assert plan.steps_per_epoch(40) == 2  # 20 samples a worker, 4 a micro-step, 2 micro-steps a step
    plan.check_split("train", 16, "here")
    with pytest.raises(ConfigError, match="fewer than one step"):
        plan.check_split("train", 15, "here")
    with pytest.raises(ConfigError, match="the valid split of here has 1 samples, fewer than the 2 workers"):
        plan.check_split("valid", 1, "here")


def test_a_config_is_frozen_and_a_change_is_a_new_config(tmp_path):
    import dataclasses

    cfg, _ = load_config(write(tmp_path, "job: {name: tests.toy_job}\n"), ["optim.betas.0=0.8"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.job.samples = 3
    changed = with_values(cfg, {"optim.lr": 0.5, "optim.betas.1": 0.9, "job.samples": 3})
    assert (changed.optim.lr, changed.optim.betas, changed.job.samples) == (0.5, [0.8, 0.9], 3)
    assert (cfg.optim.lr, cfg.optim.betas, cfg.job.samples) == (1e-3, [0.8, 0.999], 64)
    with pytest.raises(ConfigError, match="unknown config key 'optim.lrr'"):
        with_values(cfg, {"optim.lrr": 1})
    assert cfg.run.name == "tests.toy_job-cfg"  # named after the job and the file


def test_the_plan_is_made_once_frozen_and_travels_as_plain_values(tmp_path):
    import dataclasses
    import json

    from raytpu.config.plan import Facts, make_plan
    from raytpu.runtime.placement import ClusterOffer, NodeType

    path = write(tmp_path, "job: {name: tests.toy_job}\nscaling: {num_workers: 2}\n")
    cfg, _ = load_config(path, ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"])
    tpu = NodeType("tpu_v5e_8", {"CPU": 8.0, "TPU": 8.0}, max_count=1)
    offer = ClusterOffer(nodes=({"CPU": 4.0},), available={"CPU": 4.0}, node_types=(tpu,), node_types_from="test")
    script = ScriptPlan(path="/a.py", args=("--x", "1"), state="s", mixed_precision="auto")
    facts = Facts(mode="train", offer=offer, where="here", split_sizes=(("train", 64),), command="c1", script=script)
    plan = make_plan(
        with_values(cfg, {"run.storage_path": "/runs", "run.name": "mine", "scaling.runtime": "cpu"}), facts
    )
    assert (cfg.scaling.runtime, cfg.data.global_batch_size) == ("auto", 8)  # the user's config, unchanged
    assert (plan.config.scaling.runtime, plan.config.data.global_batch_size) == ("cpu", 16)
    assert plan.asked.scaling.runtime == "cpu" and plan.script.mixed_precision == "no"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.config = cfg
    assert plan.run_dir == "/runs/mine" and plan.batch == BatchPlan(16, 2, 2) and plan.mode == "train"
    again = Plan.from_dict(json.loads(json.dumps(plan.as_dict())))
    assert again == plan
    smaller = plan.remade({"loop.grad_accum": 4}, command="c2")  # a new plan, by the same function
    assert (smaller.batch.grad_accum, smaller.facts.command) == (4, "c2") and plan.batch.grad_accum == 2
    auto = make_plan(with_values(cfg, {"scaling.num_workers": 1}), facts)  # a TPU node the cluster can start
    assert auto.config.scaling.runtime == "xla" and auto.config.scaling.resources_per_worker["TPU"] == 8
    assert auto.config.data.global_batch_size == 4 * 8 * 2  # per device: a chip
    assert auto.notes[0].startswith("scaling.runtime auto -> xla: the autoscaler can start TPU nodes")


def test_a_flag_needs_a_value():
    with pytest.raises(ConfigError, match="needs a value"):
        read_overrides(["--lr"], {"--lr": "optim.lr"})


def test_shipped_configs_load():
    for path in ("jobs/mshnet/small.yaml", "jobs/mshnet/irstd1k.yaml"):
        cfg, job = load_config(path)
        assert job.name == "mshnet" and cfg.data.global_batch_size > 0


def test_extract_takes_a_commands_own_options_out():
    rest, found = extract(
        ["a.b=1", "--address", "h:1", "--search=x=1", "--search", "y=2", "--no-wait", "--epochs", "2"],
        valued=["--address"],
        repeated=["--search"],
        switches=["--no-wait"],
    )
    assert rest == ["a.b=1", "--epochs", "2"]
    assert found == {"--address": ["h:1"], "--search": ["x=1", "y=2"], "--no-wait": []}
    with pytest.raises(ConfigError, match="--address needs a value"):
        extract(["--address"], valued=["--address"])
