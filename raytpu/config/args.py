"""The one argument layer: dotted overrides, flag aliases and subcommand options, for every command.

Words after a config on the command line are ``section.key=value`` overrides, flags a job or a
tool accepts as aliases of config keys (``--batch-size 8``), and the subcommand's own options
(``--address``, ``--search``, ``--no-wait``). :func:`extract` takes a command's own options out;
:func:`read_overrides` turns the rest into :class:`Override` values.

A value that sets one key stays the text the user typed (:class:`Typed`) until its field's type
is known (``raytpu.config.loading.coerce``), as argparse reads a flag by its ``type``: a string
field keeps ``0755`` and ``no`` as typed, a number field takes a decimal number or refuses. Values
that are lists, mappings or a flag's own argument are read as YAML 1.2 (``raytpu.config.yaml_core``).
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from raytpu.config.yaml_core import YAMLError, load_yaml
from raytpu.errors import ConfigError

#: ``section.key=value``: never the value of a flag
OVERRIDE = re.compile(r"^[A-Za-z_]\w*\.[\w.]*=")


class Typed(str):
    """A value as typed on the command line, read by the type of the field it sets."""


def parse_value(text: str) -> Any:
    """``text`` read as YAML 1.2 (a list, a mapping, a number...); as it is when it is no YAML."""
    try:
        return load_yaml(text)
    except YAMLError:
        return text


def extract(
    items: list[str], valued: Iterable[str] = (), repeated: Iterable[str] = (), switches: Iterable[str] = ()
) -> tuple[list[str], dict[str, list[str]]]:
    """Take a command's own options out of ``items``: ``valued`` flags (``--flag V`` or ``--flag=V``;
    the last one wins), ``repeated`` ones (every value kept) and ``switches`` (no value).
    Returns the other words, in order, and ``{flag: [values]}`` (a switch maps to ``[]``)."""
    valued, repeated, switches = set(valued), set(repeated), set(switches)
    declared = {spelling(flag): flag for flag in valued | repeated | switches}
    rest: list[str] = []
    found: dict[str, list[str]] = {}
    index = 0
    while index < len(items):
        item = items[index]
        flag, sep, value = item.partition("=")
        flag = declared.get(spelling(flag), flag) if flag.startswith("--") else flag
        index += 1
        if flag in switches and not sep:
            found[flag] = []
        elif flag in valued | repeated:
            if not sep:
                if index >= len(items) or items[index].startswith("--"):
                    raise ConfigError(f"{flag} needs a value, e.g. {flag} VALUE")
                value = items[index]
                index += 1
            found[flag] = [*found.get(flag, []), value] if flag in repeated else [value]
        else:
            rest.append(item)
    return rest, found


def take_flag(items: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` / ``flag=VALUE`` from ``items`` in place; its value, or ``None``."""
    rest, found = extract(items, valued=[flag])
    items[:] = rest
    return found[flag][0] if flag in found else None


@dataclass(frozen=True)
class Flag:
    """A flag that is more than ``--flag VALUE`` -> one key: a bare boolean (``--bf16``, optionally
    followed by ``true``/``false`` as Transformers' parser takes it), a value turned into several
    keys or checked (``convert``), or a flag accepted and ignored with a one-line warning."""

    key: str = ""
    switch: bool = False
    convert: Callable[[Any], list[tuple[str, Any]]] | None = None
    ignored: str = ""  # why the flag has no effect (printed as a warning)
    text: bool = False  # ``convert`` takes the value as typed, not read as YAML
    refused: str = ""  # a known flag raytpu does not take: what to use instead (an error)
    sets: str = ""  # what a converted flag sets, in words (``raytpu train --help``)

    def pairs(self, flag: str, value: Any) -> list[tuple[str, Any]]:
        if self.refused:
            raise ConfigError(f"{flag} is not supported by raytpu: {self.refused}")
        if self.ignored:
            warn(f"{flag} {value} is ignored: {self.ignored}")
            return []
        typed = isinstance(value, str)  # a switch's value is already a bool
        if self.convert is not None:
            return self.convert(parse_value(value) if typed and not self.text else value)
        return [(self.key, Typed(value) if typed else value)]


Alias = str | Flag
BOOLEAN_WORDS = {"true": True, "false": False, "yes": True, "no": False, "1": True, "0": False}


def warn(text: str) -> None:
    print(f"raytpu: warning: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Override:
    """One config value from the command line: the key it sets, its value, and the words that
    set it as the user typed them (``--learning_rate fast``, ``optim.lr=fast``)."""

    key: str
    value: Any
    typed: str


def read_overrides(items: list[str], aliases: Mapping[str, Alias]) -> list[Override]:
    """``["a.b=1", "--batch-size", "8", "--lr=0.1", "--bf16"]`` -> one :class:`Override` each (``a.b``
    set to 1, ...), with the words that set it; ``aliases`` maps flags and short keys to dotted keys
    or :class:`Flag` rules."""
    overrides: list[Override] = []
    index = 0
    while index < len(items):
        item = items[index]
        index += 1
        if item.startswith("--"):
            flag, sep, value = item.partition("=")
            alias = find_alias(flag, aliases)
            if alias is None:
                raise ConfigError(unknown_flag_message(flag, aliases))
            rule = alias if isinstance(alias, Flag) else Flag(key=alias)
            if rule.switch:
                typed = item
                if not sep and index < len(items) and items[index].lower() in BOOLEAN_WORDS:
                    value, sep = items[index], "="
                    typed = f"{flag} {value}"
                    index += 1
                parsed = BOOLEAN_WORDS.get(value.lower()) if sep else True
                if parsed is None:
                    raise ConfigError(f"flag {flag} takes no value or true/false, got {value!r}")
                overrides.extend(Override(key, v, typed) for key, v in rule.pairs(flag, parsed))
                continue
            typed = item
            if not sep:
                if index >= len(items) or items[index].startswith("--") or OVERRIDE.match(items[index]):
                    raise ConfigError(f"flag {flag} needs a value, e.g. {flag} VALUE")
                value = items[index]
                typed = f"{flag} {value}"
                index += 1
            if not value.strip():
                raise ConfigError(f"flag {flag} has an empty value; write {flag}=VALUE")
            pairs = rule.pairs(flag, value)
            overrides.extend(Override(key, v, typed) for key, v in pairs)
        elif "=" in item:
            key, value = item.split("=", 1)
            if not key.strip():
                raise ConfigError(f"override {item!r} has no key; write KEY=VALUE, e.g. optim.lr=0.01")
            if not value.strip():
                raise ConfigError(f"override {item!r} has no value; write {key}=VALUE")
            alias = aliases.get(key, key)
            overrides.append(Override(alias if isinstance(alias, str) else alias.key or key, Typed(value), item))
        else:
            raise ConfigError(f"override {item!r} is not key=value (e.g. optim.lr=0.01)")
    return overrides


def spelling(flag: str) -> str:
    """A long flag's words however they are joined: ``--max-failures`` and ``--max_failures`` are one flag."""
    return flag.replace("_", "-")


def other_spelling(flag: str) -> str:
    """``--max-failures`` for ``--max_failures``, and back."""
    words = flag[2:]
    return "--" + (words.replace("-", "_") if "-" in words else words.replace("_", "-"))


def find_alias(flag: str, aliases: Mapping[str, Alias]) -> Alias | None:
    """The alias of ``flag`` as typed, or under its other spelling (``-`` for ``_``, or back)."""
    if flag in aliases:
        return aliases[flag]
    wanted = spelling(flag)
    return next((alias for name, alias in aliases.items() if name.startswith("--") and spelling(name) == wanted), None)


def unknown_flag_message(flag: str, aliases: Mapping[str, Alias]) -> str:
    close = similar_flags(flag, [a for a in aliases if a.startswith("--")])
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    if "_" in flag and not close:
        hint = "; it is not among the TrainingArguments flags raytpu supports (raytpu train --help lists them)"
    return f"unknown flag {flag}{hint}"


def similar_flags(flag: str, candidates: Iterable[str]) -> list[str]:
    """Flags that may be what ``flag`` meant: the same words but for a typo, or one word more or
    less (of at least two). Never a flag that merely shares a word (``--name`` for ``--dataset_name``)."""
    words = spelling(flag).lstrip("-").split("-")
    found: dict[str, str] = {}
    for candidate in candidates:
        other = spelling(candidate).lstrip("-").split("-")
        short, long = sorted((words, other), key=len)
        if len(long) - len(short) > 1 or (len(long) > len(short) and len(short) < 2):
            continue
        if all(any(similar_words(word, match) for match in long) for word in short):
            found.setdefault(spelling(candidate), candidate)
    return list(found.values())[:3]


def similar_words(one: str, other: str) -> bool:
    return one == other or difflib.SequenceMatcher(None, one, other).ratio() >= 0.75


def mapping_as_flags(section: str, mapping: Any) -> list[str]:
    """A YAML section of flags (``training_arguments: {learning_rate: 3e-4, bf16: true}``) as the
    command-line words that say the same (``--learning_rate=0.0003 --bf16=true``)."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"{section} must be a mapping of flag names to values, got {mapping!r}")
    words = []
    for name, value in mapping.items():
        text = json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)
        words.append(f"--{name}={text}")
    return words


def parse_options(items: list[str], fn: Callable[..., Any]) -> dict[str, Any]:
    """``["--n-train", "8", "--size=32"]`` -> ``{"n_train": 8, "size": 32}``, checked against the
    keyword parameters of ``fn`` (a job's ``synthesize``)."""
    accepted = [p for p in inspect.signature(fn).parameters if p not in ("self", "out")]
    options: dict[str, Any] = {}
    index = 0
    while index < len(items):
        item = items[index]
        if not item.startswith("--"):
            raise ConfigError(f"unexpected argument {item!r}; options look like --name value")
        key, sep, value = item[2:].partition("=")
        if not sep:
            if index + 1 >= len(items):
                raise ConfigError(f"option --{key} needs a value")
            value = items[index + 1]
            index += 1
        name = key.replace("-", "_")
        if name not in accepted:
            flags = ", ".join("--" + p.replace("_", "-") for p in accepted)
            raise ConfigError(f"unknown option --{key}; this job accepts {flags}")
        options[name] = parse_value(value)
        index += 1
    return options


class Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one ``raytpu: error:`` line (exit 2), not usage text,
    shows an option as declared (:func:`take_both_spellings` adds the other spelling), and makes
    the text after the options when the help is asked for."""

    #: makes the text shown after the options, when the help is asked for
    more_help: Callable[[], str] | None = None

    def parse_known_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        take_both_spellings(self)
        return super().parse_known_args(*args, **kwargs)

    def _get_formatter(self) -> argparse.HelpFormatter:
        return DeclaredNames(prog=self.prog)

    def format_help(self) -> str:
        if self.more_help is not None and self.epilog is None:
            self.epilog = self.more_help()
        return super().format_help()

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def take_both_spellings(parser: argparse.ArgumentParser) -> None:
    """Every long option of ``parser`` and its subcommands also under its other spelling (``-`` for
    ``_``, or back), which its help does not show (:class:`DeclaredNames`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                take_both_spellings(child)
            continue
        others = [other_spelling(name) for name in action.option_strings if name.startswith("--")]
        others = [other for other in dict.fromkeys(others) if other not in parser._option_string_actions]
        if others:
            action.declared = list(action.option_strings)  # type: ignore[attr-defined]
            action.option_strings = [*action.option_strings, *others]
            parser._option_string_actions.update(dict.fromkeys(others, action))


class DeclaredNames(argparse.RawDescriptionHelpFormatter):
    """Help that names an option as declared, not under the other spelling it also takes."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        declared = getattr(action, "declared", None)
        if declared is None or not action.option_strings:
            return super()._format_action_invocation(action)
        every, action.option_strings = action.option_strings, declared
        try:
            return super()._format_action_invocation(action)
        finally:
            action.option_strings = every
