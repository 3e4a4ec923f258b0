"""What ``raytpu train --help`` lists after its own options: every flag read as a config key, under
headings (raytpu's short flags, Transformers' and Accelerate's, each shipped job's seed-script
flags, the accepted-but-ignored and the refused ones), with the key each sets and its default."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from raytpu.config.args import Alias, Flag
from raytpu.config.loading import COMMON_ALIASES, to_dict
from raytpu.config.schema import Config
from raytpu.config.training_args import TRAINING_ARGUMENTS
from raytpu.job import known_jobs, load_job

#: the column where a flag's meaning starts
WIDTH = 34

OVERRIDES = (
    "KEY=VALUE sets any key of the config: optim.lr=0.01 loop.epochs=3 scaling.num_workers=4 (every key and\n"
    "its default: docs/configuration.md). Every long flag takes - or _ between its words."
)


def flag_list(command_flags: Mapping[str, Alias] | None = None, command: str = "") -> str:
    """The text: one heading per kind of flag, a line per flag; ``command_flags``: a command's own
    flags (``raytpu tune``'s), listed first, which win over the others of the same name."""
    defaults = to_dict(Config())
    mine = dict(command_flags or {})
    own = {
        flag: alias
        for flag, alias in COMMON_ALIASES.items()
        if flag.startswith("--") and flag not in TRAINING_ARGUMENTS and flag not in mine
    }
    rules = {flag: alias if isinstance(alias, Flag) else Flag(key=alias) for flag, alias in TRAINING_ARGUMENTS.items()}
    used = {flag: rule for flag, rule in rules.items() if not (rule.ignored or rule.refused)}
    parts = [
        "After the config, these flags set config keys (the key each sets, with its default).",
        *([section(f"raytpu {command}'s flags", mine, defaults)] if mine else []),
        section("raytpu's short flags", own, defaults),
        section("Transformers' TrainingArguments and run_clm.py flags, Accelerate's --mixed_precision", used, defaults),
        "accepted and ignored (a warning says why):\n"
        + "\n".join(line(flag, rule.ignored) for flag, rule in rules.items() if rule.ignored),
        "Transformers flags raytpu does not take, and what to use instead:\n"
        + "\n".join(line(flag, rule.refused) for flag, rule in rules.items() if rule.refused),
        *job_sections(known_jobs()),
        OVERRIDES,
    ]
    return "\n\n".join(parts)


def job_sections(names: Iterable[str]) -> list[str]:
    """Each shipped job's own flags (with the defaults of its config class)."""
    found = []
    for name in names:
        try:
            job = load_job(name)
        except ValueError as exc:  # its extra is not installed
            found.append(f"job {name}'s flags: not listed ({exc})")
            continue
        if job.aliases:
            defaults = {**to_dict(Config()), "job": to_dict(job.config_class())}
            found.append(section(f"job {name}'s flags (its seed scripts' names)", job.aliases, defaults))
    return found


def section(title: str, aliases: Mapping[str, Alias], defaults: dict[str, Any]) -> str:
    rows = [line(flag, meaning(alias, defaults)) for flag, alias in aliases.items() if flag.startswith("--")]
    return f"{title}:\n" + "\n".join(rows)


def meaning(alias: Alias, defaults: dict[str, Any]) -> str:
    """The key a flag sets, with its default; a converted flag's own words."""
    rule = alias if isinstance(alias, Flag) else Flag(key=alias)
    if rule.sets:
        return rule.sets
    if not rule.key:
        return ""
    default = default_of(rule.key, defaults)
    return rule.key if default is None else f"{rule.key} (default {default})"


def default_of(key: str, defaults: dict[str, Any]) -> Any:
    value: Any = defaults
    for part in key.split("."):
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return None if value in ("", [], {}) else value


def line(flag: str, text: str) -> str:
    return f"  {flag:<{WIDTH - 3}} {text}" if len(flag) < WIDTH - 3 else f"  {flag}\n{' ' * WIDTH}{text}"
