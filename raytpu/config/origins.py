"""Where each config value came from, so that an error about it names what the user wrote.

A value is set by a YAML file (``jobs/x.yaml:12``), by a flag (``--learning_rate fast``) or by a
dotted override (``optim.lr=fast``). The checks speak in config keys (``optim.lr must be a
number``); :meth:`Origins.explain` puts the file and line, or the flag as typed, in front of such
a message. A dotted override needs nothing more: the user typed the key the message names.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from raytpu.errors import ConfigError

#: a dotted config key as messages write it (``optim.lr``, ``job.model_config.hidden_size``)
DOTTED = re.compile(r"(?<![\w./])[A-Za-z_]\w*(?:\.\w+)+")


@dataclass(frozen=True)
class Origins:
    """Dotted config key -> where its value was written (``"jobs/x.yaml:12"``, ``"--lr 0"``; empty
    for a ``key=value`` override, whose key is already what the user typed)."""

    by_key: dict[str, str] = field(default_factory=dict)

    def merged(self, other: dict[str, str]) -> Origins:
        """These origins with ``other``'s on top (a flag wins over the file it overrides)."""
        return Origins({**self.by_key, **other})

    def explain(self, exc: Exception) -> ConfigError:
        """``exc`` as a :class:`ConfigError` whose message starts with where the value it names
        came from; unchanged when it names no key with an origin, or already says where (it
        starts with that origin, or with the flag the user typed)."""
        message = " ".join(str(exc).split()) or type(exc).__name__
        origin = self.origin_in(message)
        if not origin or message.startswith((origin, "--")):
            return exc if isinstance(exc, ConfigError) else ConfigError(message)
        return ConfigError(f"{origin}: {message}")

    def origin_in(self, message: str) -> str | None:
        """The origin of the first config key ``message`` names: that key's own, else that of the
        last value set under it (``job.model_config`` set by ``job.model_config.hidden_size=64``)."""
        for word in DOTTED.findall(message):
            if word in self.by_key:
                return self.by_key[word]
            under = [origin for key, origin in self.by_key.items() if key.startswith(f"{word}.")]
            if under:
                return under[-1]
        return None

    def typed(self, key: str) -> bool:
        """Whether ``key``'s value was typed on the command line (a dotted override or a flag), not
        read from the config file or left at its default."""
        origin = self.by_key.get(key)
        return origin is not None and (origin == "" or origin.startswith("--"))

    @contextlib.contextmanager
    def naming_sources(self) -> Iterator[None]:
        """Errors about the config raised inside the block name the file line or flag behind them,
        and the checks inside it can ask which values were typed (:func:`typed_on_command_line`)."""
        token = ACTIVE.set(self)
        try:
            yield
        except (ConfigError, ValueError) as exc:
            raise self.explain(exc) from exc
        finally:
            ACTIVE.reset(token)


#: the origins of the config the running command read (set by :meth:`Origins.naming_sources`)
ACTIVE: contextvars.ContextVar[Origins | None] = contextvars.ContextVar("raytpu_origins", default=None)


def typed_on_command_line(key: str) -> bool:
    """Whether the running command's user typed ``key``'s value (False outside a command)."""
    origins = ACTIVE.get()
    return origins is not None and origins.typed(key)


def yaml_lines(path: Path, text: str) -> dict[str, str]:
    """Every key of a YAML config file, dotted (``optim.lr``), -> ``"<path>:<line>"``."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return {}  # the loader reports the syntax error with its line
    lines: dict[str, str] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            key = f"{prefix}{key_node.value}"
            lines[key] = f"{path}:{key_node.start_mark.line + 1}"
            walk(value_node, f"{key}.")

    if root is not None:
        walk(root, "")
    return lines
