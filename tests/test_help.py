"""``--help`` shows the interface: every flag raytpu reads as a config key, under headings, with its
key and default; hints name only flags of the same meaning; a known Transformers flag that raytpu
does not take says what to use instead; every long flag takes ``-`` or ``_`` between its words."""

from __future__ import annotations

import argparse

import pytest

from raytpu import cli
from raytpu.config import load_config
from raytpu.config.args import ConfigError, other_spelling, similar_flags
from raytpu.config.loading import COMMON_ALIASES
from raytpu.config.training_args import REFUSED
from raytpu.job import known_jobs, load_job
from tests.conftest import ROOT

SMALL = str(ROOT / "jobs/mshnet/small.yaml")
FLAGS = [flag for flag in COMMON_ALIASES if flag.startswith("--")]


@pytest.fixture(scope="module")
def train_help() -> str:
    with pytest.raises(SystemExit) as done:
        cli.build_parser().parse_args(["train", "--help"])
    assert done.value.code == 0
    return cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()


def test_train_help_lists_every_flag_under_its_heading_with_its_key(train_help):
    for heading in ("raytpu's short flags:", "Transformers' TrainingArguments", "accepted and ignored"):
        assert heading in train_help
    for flag in FLAGS:
        assert f"\n  {flag} " in train_help or f"\n  {flag}\n" in train_help, flag
    for name in known_jobs():
        for flag in load_job(name).aliases:
            assert f"\n  {flag} " in train_help, (name, flag)
    assert "--learning_rate                 optim.lr (default 0.001)" in train_help
    assert "KEY=VALUE" in train_help and "docs/configuration.md" in train_help


def test_tune_help_lists_its_own_flags_first_and_its_name_once():
    from raytpu.driver.search import FLAGS as TUNE_FLAGS

    text = cli.build_parser()._subparsers._group_actions[0].choices["tune"].format_help()
    assert text.index("raytpu tune's flags:") < text.index("raytpu's short flags:")
    for flag, key in TUNE_FLAGS.items():
        assert f"\n  {flag} " in text and key in text, flag
    assert text.count("\n  --name ") == 1 and "--name                          tune.name" in text


@pytest.mark.parametrize(
    "typed, meant, not_meant",
    [
        ("--dataset_nam", "--dataset_name", "--name"),
        ("--batch-sise", "--batch-size", None),
        ("--lerning_rate", "--learning_rate", None),
        ("--per_device_batch_size", "--per_device_train_batch_size", None),
        ("--tpu_cores", None, "--dataloader_num_workers"),
        ("--num_cores", None, "--dataloader_num_workers"),
    ],
)
def test_hints_name_flags_of_the_same_meaning_only(typed, meant, not_meant):
    found = similar_flags(typed, [*FLAGS, "--batch-size"])
    if meant:
        assert meant in found, found
    if not_meant:
        assert not_meant not in found, found


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_a_transformers_flag_raytpu_does_not_take_says_what_to_use_instead(flag):
    with pytest.raises(ConfigError) as caught:
        load_config(SMALL, [flag, "1"])
    assert str(caught.value) == f"{flag} is not supported by raytpu: {REFUSED[flag]}"


def test_the_issue_s_examples_are_answered_right():
    with pytest.raises(ConfigError, match="every chip of the slices"):
        load_config(SMALL, ["--tpu_num_cores", "8"])
    with pytest.raises(ConfigError) as caught:
        load_config(SMALL, ["--dataset-nme", "x"])
    assert "--dataset_name" in str(caught.value) and "--name," not in str(caught.value)


@pytest.mark.parametrize(
    "words, key, value",
    [
        (["--learning-rate", "0.5"], ("optim", "lr"), 0.5),
        (["--batch_size", "4"], ("data", "global_batch_size"), 4),
        (["--data_path", "elsewhere"], ("data", "path"), "elsewhere"),
        (["--per-device-train-batch-size=2"], ("data", "per_device_train_batch_size"), 2),
    ],
)
def test_a_config_flag_takes_either_spelling(words, key, value):
    cfg, _ = load_config(SMALL, words)
    assert getattr(getattr(cfg, key[0]), key[1]) == value


def test_every_long_option_of_every_command_takes_either_spelling():
    def parsers(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    checked = 0
    root = cli.build_parser()
    root.parse_args(["doctor"])  # parsing adds the other spellings, to the subcommands' too
    for parser in parsers(root):
        for action in parser._actions:
            for name in action.option_strings:
                if name.startswith("--") and ("-" in name[2:] or "_" in name[2:]):
                    assert other_spelling(name) in action.option_strings, (parser.prog, name)
                    checked += 1
    assert checked > 10
    args = cli.build_parser().parse_args(["launch", "--max_failures", "2", "--storage_path", "s", "train.py"])
    assert (args.max_failures, args.storage_path) == (2, "s")
