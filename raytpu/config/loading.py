"""Reading a config: YAML files, dotted overrides and seed-script aliases, into the typed sections.

A config file is YAML (read by the 1.2 core schema: ``raytpu.config.yaml_core``) with one section
per dataclass of ``raytpu.config.schema`` plus ``job:`` (the job's own dataclass, selected by
``job.name``). Command-line overrides are ``section.key=value`` or a seed script's flag
(``--batch-size 8``), read by ``raytpu.config.args``; their values are read by the type of the
field they set (:func:`coerce`). Any unknown key fails with the closest valid keys. The result is
frozen: :func:`with_values` makes a changed copy.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from raytpu.config.args import (
    BOOLEAN_WORDS,
    Alias,
    ConfigError,
    Flag,
    Override,
    Typed,
    mapping_as_flags,
    parse_value,
    read_overrides,
)
from raytpu.config.origins import Origins, yaml_lines
from raytpu.config.schema import Config
from raytpu.config.training_args import TRAINING_ARGUMENTS
from raytpu.config.validation import validate
from raytpu.config.yaml_core import load_yaml
from raytpu.job import Job, JobConfig, Tabular, load_job


def profile_window(value: Any) -> list[tuple[str, Any]]:
    """``--profile FIRST:LAST`` (or one step, ``--profile 5``): ``loop.profile_steps``."""
    first, _, last = str(value).partition(":")
    try:
        return [("loop.profile_steps", [int(first), int(last or first)])]
    except ValueError:
        raise ConfigError(f"--profile {value}: give the steps to trace as FIRST:LAST, e.g. --profile 10:12") from None


#: keys under their earlier names, still read (in a file and on the command line): old -> new
RENAMED_KEYS = {
    "xla.fsdp_layers": "sharding.layers",
    "xla.grad_ckpt": "sharding.activation_checkpointing",
    "xla.mesh.data": "sharding.mesh.data",
    "xla.mesh.fsdp": "sharding.mesh.fsdp",
}

#: the mesh's axes in torchprime's names (``ici_mesh.fsdp=4``): its mesh within a slice is raytpu's mesh
MESH_ALIASES = {f"ici_mesh.{axis}": f"sharding.mesh.{axis}" for axis in ("data", "fsdp", "tensor")}


#: keys that take a range, ``MIN:MAX`` (torchrun's ``--nnodes`` form) or ``[MIN, MAX]``, for an elastic
#: run: the key keeps the largest size, and this key the smallest (0: a fixed size)
RANGES = {"scaling.num_workers": "scaling.min_workers", "scaling.tpu.slices": "scaling.tpu.min_slices"}


def range_of(key: str, value: Any) -> tuple[int, int] | None:
    """``(MIN, MAX)`` of a range value (``"1:4"``, ``[1, 4]``), or None for a single value."""
    if isinstance(value, Typed) and value.strip().startswith("["):
        value = parse_value(str(value))
    if isinstance(value, str) and ":" in value:
        low, _, high = value.partition(":")
        if not (re.fullmatch(r"\s*[0-9]+\s*", low) and re.fullmatch(r"\s*[0-9]+\s*", high)):
            raise ConfigError(f"{key}={value!r}: a range is MIN:MAX in whole numbers, e.g. {key}=1:4")
        return at_least_one(key, int(low), int(high))
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{key}={value!r}: a range is two whole numbers [MIN, MAX], e.g. [1, 4]")
        return at_least_one(key, int(value[0]), int(value[1]))
    return None


def at_least_one(key: str, low: int, high: int) -> tuple[int, int]:
    """A range whose smallest size can run: a run cannot go on with none."""
    if low < 1:
        raise ConfigError(f"{key}={low}:{high}: a run cannot go on with 0; the smallest size is 1 or more (1:{high})")
    return low, high


def expanded(key: str, value: Any) -> list[tuple[str, Any]]:
    """``key=value`` as the keys it sets: a range sets its largest size and its smallest; a single
    number typed by the user makes the size fixed again (internal values set the size alone)."""
    if key not in RANGES:
        return [(key, value)]
    bounds = range_of(key, value)
    if bounds is not None:
        return [(key, bounds[1]), (RANGES[key], bounds[0])]
    return [(key, value), (RANGES[key], 0)] if isinstance(value, Typed) else [(key, value)]


def expand_file_ranges(raw: dict[str, Any]) -> None:
    """A file's range values (``num_workers: 1:4``) as its two keys, in place."""
    for key, low_key in RANGES.items():
        *parents, name = key.split(".")
        section = raw
        for part in parents:
            section = section.get(part) if isinstance(section, dict) else None
        if isinstance(section, dict) and name in section:
            bounds = range_of(key, section[name])
            if bounds is not None:
                section[name], section[low_key.rsplit(".", 1)[1]] = bounds[1], bounds[0]


#: flags and short keys every job accepts: alias -> dotted key
COMMON_ALIASES: dict[str, Alias] = {
    **RENAMED_KEYS,
    **MESH_ALIASES,
    "--profile": Flag(convert=profile_window, text=True, sets="loop.profile_steps (FIRST:LAST: trace those steps)"),
    "runtime": "scaling.runtime",
    "num_workers": "scaling.num_workers",
    "precision": "scaling.precision",
    "--name": "run.name",
    "--seed": "run.seed",
    "--data-path": "data.path",
    **TRAINING_ARGUMENTS,
}


# ---------------------------------------------------------------------- build
def load_config(path: str | Path | None, overrides: list[str] | None = None) -> tuple[Config, Job]:
    """Read a YAML file, apply ``overrides`` and return the typed config and its job."""
    cfg, job, _ = read_config(path, overrides)
    return cfg, job


def read_config(
    path: str | Path | Mapping[str, Any] | Config | None, overrides: list[str] | None = None
) -> tuple[Config, Job, Origins]:
    """:func:`load_config`, with where each value came from; an error about a value names its
    file and line, or the flag that set it. ``path`` may also be the sections themselves: a mapping
    (as a YAML file holds them) or a :class:`Config` (the Python API's forms)."""
    raw: dict[str, Any] = {}
    origins = Origins()
    if isinstance(path, (Mapping, Config)):
        raw = copy.deepcopy(to_dict(path) if isinstance(path, Config) else dict(path))
        path = None
    elif path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found; pass a YAML file such as jobs/mshnet/small.yaml")
        text = read_text(path)
        raw = parse_yaml(path, text)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        origins = Origins(yaml_lines(path, text))
    move_renamed_keys(raw)
    expand_file_ranges(raw)
    job_section = raw.get("job") or {}
    if isinstance(job_section, str):
        job_section = {"name": job_section}
        raw["job"] = job_section
    with origins.naming_sources():
        from_file = section_flags(raw, origins)
        found = read_overrides(list(from_file) + list(overrides or []), job_aliases_for(raw, overrides or []))
    origins = origins.merged({o.key: typed_origin(o, from_file) for o in found})
    pairs = [(o.key, o.value) for o in found]
    job_name = dict(pairs).get("job.name", job_section.get("name"))
    if not job_name:
        raise ConfigError("no job given: set `job: {name: <job>}` in the config or pass job.name=<job>")
    job = load_job(str(job_name))
    typed = {o.key[4:]: o.value for o in found if o.typed not in from_file and o.key.startswith("job.")}
    replaced = job.replaced_in_file(job_section, typed)
    job_section = {key: value for key, value in job_section.items() if key not in replaced}
    raw["job"] = {**job_section, "name": str(job_name)}  # a job config class may default to no name
    with origins.naming_sources():
        cfg = with_values(build_dataclass(Config, raw, "", {"job": job.config_class}), pairs)
        if not cfg.run.name:  # a run is named after its job and config file unless named
            stem = Path(path).stem if path is not None else "run"
            cfg = with_values(cfg, {"run.name": f"{job.name}-{stem}"})
        cfg = read_buckets_through_ray_data(cfg, job)
        validate(cfg, job)
    return cfg, job, origins


def move_renamed_keys(raw: dict[str, Any]) -> None:
    """A file's keys under their earlier names (:data:`RENAMED_KEYS`) moved to the current ones, in place."""
    for old, new in RENAMED_KEYS.items():
        *old_parents, old_key = old.split(".")
        section = nested_section(raw, old_parents, create=False)
        if isinstance(section, dict) and old_key in section:
            *new_parents, new_key = new.split(".")
            target = nested_section(raw, new_parents, create=True)
            if isinstance(target, dict):
                target.setdefault(new_key, section.pop(old_key))
            if not section and len(old_parents) > 1:  # an emptied xla.mesh: no section of that name is left
                nested_section(raw, old_parents[:-1], create=False).pop(old_parents[-1])


def nested_section(raw: dict[str, Any], parents: list[str], create: bool) -> Any:
    """``raw[a][b]...`` for ``parents`` [a, b, ...]; made empty where missing if ``create``, else None."""
    section: Any = raw
    for part in parents:
        if not isinstance(section, dict):
            return None
        if create and not isinstance(section.get(part), dict):
            section[part] = {} if section.get(part) in (None, {}) else section[part]
        section = section.get(part)
    return section


def read_buckets_through_ray_data(cfg: Config, job: Job) -> Config:
    """A bucket in ``data.path`` is read through Ray Data (``data.loader=ray``: the parquet tables
    ``raytpu data prepare`` wrote there); a job without such tables needs a folder, and says so."""
    if "://" not in cfg.data.path or cfg.data.path.startswith("file://") or cfg.data.loader == "ray":
        return cfg
    if not isinstance(job, Tabular):
        raise ConfigError(
            f"data.path={cfg.data.path} is a bucket, and job {job.name!r} reads a folder (it has no parquet tables "
            "for data.loader=ray): give a folder that every node has"
        )
    return with_values(cfg, {"data.loader": "ray"})


def typed_origin(override: Override, from_file: dict[str, str]) -> str:
    """Where ``override`` came from, for an error's first words: its line when the file's
    ``training_arguments:`` set it, the flag as typed, or nothing for a dotted key the user typed."""
    if override.typed in from_file:
        return from_file[override.typed]
    return "" if override.typed.startswith(f"{override.key}=") else override.typed


def section_flags(raw: dict[str, Any], origins: Origins) -> dict[str, str]:
    """A file's ``training_arguments:`` section as the flags that say the same (taken out of
    ``raw``), each mapped to its line in the file (``training_arguments.learning_rate``)."""
    if "training_arguments" not in raw:
        return {}
    section = raw.pop("training_arguments")
    words = mapping_as_flags("training_arguments", section)
    lines = [origins.by_key.get(f"training_arguments.{name}", "training_arguments") for name in section]
    return {word: f"{line} (training_arguments.{name})" for word, line, name in zip(words, lines, section)}


def read_text(path: Path) -> str:
    """A config file's text; one that cannot be read, or is not UTF-8, is a one-line error naming it."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at position {exc.start}): "
            "save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc}): check its permissions") from None


def read_yaml(path: Path) -> Any:
    """A YAML file's content; a syntax error names the file, line and column."""
    return parse_yaml(path, read_text(path))


def parse_yaml(path: Path, text: str) -> Any:
    try:
        return load_yaml(text) or {}
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: YAML syntax error: {exc.problem or exc.context}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: YAML syntax error: {' '.join(str(exc).split())}") from exc


def job_aliases_for(raw: dict[str, Any], overrides: list[str]) -> dict[str, Alias]:
    """Aliases of the job named in the file or the overrides (seed flags)."""
    name = (raw.get("job") or {}).get("name")
    for item in overrides:
        if item.startswith("job.name="):
            name = item.split("=", 1)[1]
    aliases = dict(COMMON_ALIASES)
    if name:
        aliases.update(load_job(str(name)).aliases)
    return aliases


def build_dataclass(cls: type, raw: Any, prefix: str, substitutions: dict[str, type] | None = None) -> Any:
    """Build ``cls`` from a mapping, recursively, rejecting unknown keys."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(unknown_key_message(f"{prefix}{key}", [f"{prefix}{n}" for n in names]))
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if substitutions and f.name in substitutions:
                values[f.name] = substitutions[f.name]()
            continue
        field_type = (substitutions or {}).get(f.name, hints[f.name])
        values[f.name] = coerce(raw[f.name], field_type, f"{prefix}{f.name}")
    return cls(**values)


def coerce(value: Any, field_type: Any, key: str) -> Any:
    """Check/convert ``value`` to ``field_type`` with a message naming ``key``."""
    if isinstance(value, Typed):
        value = read_typed(value, field_type, key)
    if dataclasses.is_dataclass(field_type):
        return build_dataclass(field_type, value, f"{key}.")
    origin = typing.get_origin(field_type)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item_type, *_) = typing.get_args(field_type) or (Any,)
        return [coerce(v, item_type, key) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        return value
    if field_type is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if field_type is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if field_type is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if field_type is str:
        if isinstance(value, bool):
            return "true" if value else "false"  # YAML reads an unquoted true/false as a bool
        return "" if value is None else str(value)
    if field_type is float and isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads "1e-4" as a string
        except ValueError:
            pass
    if field_type in (int, float):
        raise ConfigError(f"{key} must be a number ({field_type.__name__}), got {value!r}")
    return value


def read_typed(text: Typed, field_type: Any, key: str) -> Any:
    """A value typed on the command line, read as its field asks (argparse's ``type``): a string as
    typed, a boolean from true/false/yes/no/1/0, a whole or decimal number written in decimal, or
    one line naming the field and the text; lists, mappings and the rest as YAML 1.2."""
    if field_type is str:
        return str(text)
    if field_type is bool:
        if text.strip().lower() not in BOOLEAN_WORDS:
            raise ConfigError(f"{key} must be true or false, got {str(text)!r}")
        return BOOLEAN_WORDS[text.strip().lower()]
    if field_type is int:
        if not re.fullmatch(r"[-+]?[0-9]+", text.strip()):
            raise ConfigError(f"{key} must be a number (int), got {str(text)!r}")
        return int(text.strip())
    if field_type is float:
        try:
            return float(text.strip())
        except ValueError:
            raise ConfigError(f"{key} must be a number (float), got {str(text)!r}") from None
    return parse_value(str(text))


def unknown_key_message(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return f"unknown config key {key!r}{hint}"


def all_keys(obj: Any, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(all_keys(value, f"{prefix}{f.name}."))
    return keys


def with_values(cfg: Any, values: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Any:
    """A copy of ``cfg`` with each dotted key set (``optim.lr``, ``optim.betas.0``), with the same
    checks as a file; ``cfg`` itself is frozen and never changes."""
    for given_key, given in values.items() if isinstance(values, Mapping) else values:
        for key, value in expanded(given_key, given):
            if key == "job.name":
                if value != cfg.job.name:
                    raise ConfigError("job.name cannot change the job of a config file; use another config")
                continue
            cfg = replaced(cfg, cfg, key.split("."), value, key)
    return cfg


def replaced(root: Any, target: Any, parts: list[str], value: Any, key: str) -> Any:
    """``target`` with the value at ``parts`` replaced (a list item when the last part is a number)."""
    name, rest = parts[0], parts[1:]
    if not dataclasses.is_dataclass(target) or name not in {f.name for f in dataclasses.fields(target)}:
        raise ConfigError(unknown_key_message(key, all_keys(root)))
    field_type = typing.get_type_hints(type(target))[name]
    current = getattr(target, name)
    if not rest:
        return dataclasses.replace(target, **{name: coerce(value, field_type, key)})
    if isinstance(current, dict):  # a free-form mapping (a Transformers config's fields): any key
        value = parse_value(str(value)) if isinstance(value, Typed) else value
        return dataclasses.replace(target, **{name: with_item(current, rest, value)})
    if len(rest) == 1 and rest[0].isdigit() and isinstance(current, list):
        index = int(rest[0])
        if not 0 <= index < len(current):
            raise ConfigError(unknown_key_message(key, all_keys(root)))
        items = list(current)
        items[index] = coerce(value, typing.get_args(field_type)[0], key)
        return dataclasses.replace(target, **{name: items})
    return dataclasses.replace(target, **{name: replaced(root, current, rest, value, key)})


def with_item(mapping: dict[str, Any], parts: list[str], value: Any) -> dict[str, Any]:
    """A copy of ``mapping`` with ``value`` at the path ``parts`` (nested mappings made as needed)."""
    name, rest = parts[0], parts[1:]
    inner = mapping.get(name)
    return {**mapping, name: with_item(inner if isinstance(inner, dict) else {}, rest, value) if rest else value}


# --------------------------------------------------------------------- dump
def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(data: dict[str, Any]) -> tuple[Config, Job | None]:
    """Rebuild a config (e.g. on a Ray worker) from :func:`to_dict` output; a config without a job
    (``raytpu launch`` schedules a script) has none."""
    job = load_job(data["job"]["name"]) if data["job"]["name"] else None
    return build_dataclass(Config, data, "", {"job": job.config_class if job else JobConfig}), job
