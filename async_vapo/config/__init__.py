"""One pydantic config tree, loaded from TOML files in configs/ with key.sub=value overrides."""

from async_vapo.config.loader import ConfigError, load_config, parse_override, save_resolved
from async_vapo.config.schema import (
    AlgoConfig,
    AsyncConfig,
    BaseModelConfig,
    Config,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    TaskConfig,
    TrainConfig,
    VerifierConfig,
)

__all__ = [
    "AlgoConfig", "AsyncConfig", "BaseModelConfig", "Config", "ConfigError", "ModelConfig", "OptimConfig",
    "RolloutConfig", "TaskConfig", "TrainConfig", "VerifierConfig", "load_config", "parse_override",
    "save_resolved",
]
