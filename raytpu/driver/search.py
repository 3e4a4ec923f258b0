"""Search spaces of ``raytpu tune``: ``KEY=DOMAIN(ARGS)`` strings parsed, checked against the
config before any trial starts, and turned into Ray Tune domains."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from raytpu.config import Config, ConfigError, with_values
from raytpu.config.validation import validate

#: domain name -> number of arguments (None = one or more)
DOMAINS: dict[str, int | None] = {"choice": None, "grid": None, "uniform": 2, "loguniform": 2, "randint": 2}


@dataclass(frozen=True)
class Search:
    """One searched key: ``optim.lr=loguniform(1e-4, 1e-1)``."""

    key: str
    kind: str
    args: tuple[Any, ...]

    def domain(self) -> Any:
        from ray import tune

        if self.kind == "choice":
            return tune.choice(list(self.args))
        if self.kind == "grid":
            return tune.grid_search(list(self.args))
        if self.kind == "uniform":
            return tune.uniform(*self.args)
        if self.kind == "loguniform":
            return tune.loguniform(*self.args)
        return tune.randint(*self.args)

    def candidates(self) -> list[Any]:
        """Values to check against the config before any trial starts."""
        if self.kind in ("choice", "grid"):
            return list(self.args)
        if self.kind == "randint":
            return [self.args[0], self.args[1] - 1]
        return [float(self.args[0]), float(self.args[1])]


SEARCH_PATTERN = re.compile(r"^\s*([\w.]+)\s*=\s*(\w+)\s*\((.*)\)\s*$")


def parse_search(text: str) -> Search:
    """``"optim.lr=loguniform(1e-4,1e-1)"`` -> ``Search("optim.lr", "loguniform", (1e-4, 0.1))``."""
    example = "e.g. --search 'optim.lr=loguniform(1e-4,1e-1)'"
    match = SEARCH_PATTERN.match(text)
    if not match:
        raise ConfigError(f"search {text!r} is not key=domain(args); {example}")
    key, kind, body = match.groups()
    return make_search(key, kind, body, text)


def make_search(key: str, kind: str, body: str, text: str) -> Search:
    from raytpu.config.yaml_core import YAMLError, load_yaml

    if kind not in DOMAINS:
        raise ConfigError(f"search {text!r}: unknown domain {kind!r}; use one of {', '.join(DOMAINS)}")
    try:
        args = load_yaml(f"[{body}]")
    except YAMLError as exc:
        raise ConfigError(f"search {text!r}: cannot read the arguments {body!r}") from exc
    args = [float(a) if isinstance(a, str) and _is_number(a) else a for a in args]
    arity = DOMAINS[kind]
    if arity is None and not args:
        raise ConfigError(f"search {text!r}: {kind}() needs at least one value")
    if arity is not None:
        if len(args) != arity or not all(_is_real(a) for a in args):
            raise ConfigError(f"search {text!r}: {kind}() takes two numbers, lower and upper")
        lower, upper = args
        if not lower < upper:
            raise ConfigError(f"search {text!r}: the lower bound must be below the upper bound")
        if kind == "loguniform" and lower <= 0:
            raise ConfigError(f"search {text!r}: loguniform() needs a positive lower bound")
        if kind == "randint" and not all(isinstance(a, int) for a in args):
            raise ConfigError(f"search {text!r}: randint() takes two integers (upper bound excluded)")
    return Search(key, kind, tuple(args))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def searches_of(cfg: Config) -> list[Search]:
    """The config's ``tune.search`` mapping, parsed and checked against the config."""
    if not cfg.tune.search:
        raise ConfigError(
            "nothing to search: pass --search 'optim.lr=loguniform(1e-4,1e-1)' (repeatable) or set tune.search"
        )
    searches = [parse_search(f"{key}={expr}") for key, expr in cfg.tune.search.items()]
    for search in searches:
        if search.key.startswith("tune.") or search.key in ("job.name", "run.name", "run.storage_path"):
            raise ConfigError(f"search key {search.key!r} cannot be searched; search training settings")
        for value in search.candidates():
            validate(with_values(cfg, {search.key: value}))
    return searches
