"""YAML read by the 1.2 core schema, for config files, ``--search`` arguments and structured values
on the command line.

PyYAML implements YAML 1.1, whose implicit types surprise: ``0755`` is octal (493), ``1:30`` is
base 60 (90), ``no`` / ``off`` are false. YAML 1.2's core schema (what most YAML tools read
today) knows only ``true`` / ``false``, decimal, ``0o`` octal and ``0x`` hexadecimal integers, and
plain floats (``1e-4`` included, which YAML 1.1 reads as a string). :func:`load_yaml` is PyYAML's safe
loader with those implicit types, and nothing else changed.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

#: the implicit types of YAML 1.2's core schema: tag, pattern, first characters
CORE_TYPES = (
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
)
REPLACED = {tag for tag, _, _ in CORE_TYPES}


class CoreLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core-schema scalars."""

    def construct_core_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)  # a leading zero is decimal: 0755 is 755


CoreLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in REPLACED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern, _first in CORE_TYPES:
    CoreLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))
CoreLoader.add_constructor("tag:yaml.org,2002:int", CoreLoader.construct_core_int)


YAMLError = yaml.YAMLError


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2's core-schema scalars."""
    return yaml.load(text, Loader=CoreLoader)  # noqa: S506 (a safe loader)
