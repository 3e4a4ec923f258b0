"""The configuration: typed sections (``schema``), files and overrides (``loading``, ``args``), checks
(``validation``) and the plan the driver resolves it into (``plan``)."""

from raytpu.config.loading import build_dataclass, dump_yaml, from_dict, load_config, read_yaml, to_dict, with_values
from raytpu.config.schema import (
    CheckpointSettings,
    Config,
    DataSettings,
    LoggingSettings,
    LoopSettings,
    MeshSettings,
    OptimSettings,
    RunSettings,
    ScalingSettings,
    ShardingSettings,
    TPUSettings,
    TuneSettings,
    XLASettings,
)
from raytpu.errors import ConfigError

__all__ = [
    "CheckpointSettings",
    "Config",
    "ConfigError",
    "DataSettings",
    "LoggingSettings",
    "LoopSettings",
    "MeshSettings",
    "OptimSettings",
    "RunSettings",
    "ScalingSettings",
    "ShardingSettings",
    "TPUSettings",
    "TuneSettings",
    "XLASettings",
    "build_dataclass",
    "dump_yaml",
    "from_dict",
    "load_config",
    "read_yaml",
    "to_dict",
    "with_values",
]
