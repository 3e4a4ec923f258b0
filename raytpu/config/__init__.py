"""The configuration: typed sections (``schema``), files and overrides (``loading``, ``args``), checks
(``validation``) and the plan the driver resolves it into (``plan``)."""

from raytpu.config.loading import build_dataclass, dump_yaml, from_dict, load_config, read_yaml, to_dict, with_values
from raytpu.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LoopConfig,
    MeshConfig,
    OptimConfig,
    RunConfig,
    ScalingConfig,
    TPUConfig,
    TuneConfig,
    XLAConfig,
)
from raytpu.errors import ConfigError

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoopConfig",
    "MeshConfig",
    "OptimConfig",
    "RunConfig",
    "ScalingConfig",
    "TPUConfig",
    "TuneConfig",
    "XLAConfig",
    "build_dataclass",
    "dump_yaml",
    "from_dict",
    "load_config",
    "read_yaml",
    "to_dict",
    "with_values",
]
