"""The one preparation of every command (``raytpu.driver.commands.prepare``), walked from the
command line: each module of the walk entered at most 3 times, and what it asks (the runtime
descriptions, storage, the job) never calling back into it."""

from __future__ import annotations

import collections
import inspect
import sys

import pytest

from raytpu import cli
from raytpu.driver import commands
from tests.conftest import ROOT

#: the modules that walk the config from the command line to the plan
WALK = ("raytpu.cli", "raytpu.api", "raytpu.config.", "raytpu.driver.")


class Prepared(Exception):
    """Raised where the command would stage its prepared plan: the walk ends there."""


def walk_calls(argv: list[str], monkeypatch) -> list[tuple[str, str, str]]:
    """``(caller module, callee module, callee)`` of every call from one raytpu module into another
    while ``raytpu`` prepares ``argv``. Not calls: the code a dataclass generates, property reads
    (reading a made value), third-party code calling back (PyYAML's constructors), module bodies."""

    def staged(plan):
        raise Prepared

    monkeypatch.setattr(commands, "stage", staged)
    calls = []

    def profile(frame, event, arg):
        code, caller = frame.f_code, frame.f_back
        if event != "call" or caller is None or code.co_name == "<module>" or code.co_filename == "<string>":
            return
        callee, calling = frame.f_globals.get("__name__", ""), caller.f_globals.get("__name__", "")
        if callee.startswith("raytpu") and calling.startswith("raytpu") and callee != calling:
            calls.append((calling, callee, code))

    sys.setprofile(profile)
    try:
        with pytest.raises(Prepared):
            cli.main(argv)
    finally:
        sys.setprofile(None)
    reads = {
        value.fget.__code__
        for name, module in list(sys.modules.items())
        if name.startswith("raytpu")
        for _, cls in inspect.getmembers(module, inspect.isclass)
        for value in vars(cls).values()
        if isinstance(value, property) and value.fget
    }
    return [(calling, callee, code.co_name) for calling, callee, code in calls if code not in reads]


def test_the_walk_from_the_command_line_enters_each_module_at_most_three_times(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    job = str(ROOT / "jobs/mshnet/small.yaml")
    calls = walk_calls(["train", job, "--local", "loop.max_steps=2", "--per_device_train_batch_size", "2"], monkeypatch)
    entered = collections.Counter(callee for _, callee, _ in calls if callee.startswith(WALK))
    assert entered["raytpu.config.plan"] and entered["raytpu.driver.preflight"], entered  # the walk was followed
    assert max(entered.values()) <= 3, entered.most_common(3)
    asked_back = [call for call in calls if call[1].startswith(WALK) and not call[0].startswith(WALK)]
    assert not asked_back, asked_back
    assert "local processes: 2 cpu worker(s), fp32, 2 samples per worker (global batch 4)" in capsys.readouterr().out
