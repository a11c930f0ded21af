"""Every option of the engine, declared once: the component configs of a training run and the
checkpoint schedule, and how a run is measured (``measure.py``), each field with its help, flag and allowed values in its metadata.

Configs import nothing but each other and the family registry; the implementations import them
(``tests/test_architecture.py`` checks it).
"""

from .data import DataConfig
from .guardrails import GuardrailsConfig
from .lora import LoraConfigError, LoraSettings
from .measure import MEASURE_OPTIONS, MeasureConfig
from .model import ModelConfig
from .objective import ObjectiveConfig
from .optim import OptimizerConfig
from .options import ConfigError, ConfigWarning, Option
from .outputs import OutputConfig, ValidationConfig
from .peers.simpletuner import ALIASES
from .schedule import CheckpointSchedule, ScheduleError
from .sharding import ShardingConfig
from .train import (
    DEMO_SCHEDULE,
    NO_GUARDRAILS,
    OPTIONS,
    RESUME_KEYS,
    SAVED_BEFORE,
    TrainConfig,
    derived_seed,
    option_named,
    read_config_file,
)

__all__ = ["ALIASES", "DEMO_SCHEDULE", "NO_GUARDRAILS", "OPTIONS", "RESUME_KEYS", "SAVED_BEFORE", "CheckpointSchedule",
           "ConfigError", "ConfigWarning", "DataConfig", "GuardrailsConfig", "LoraConfigError", "LoraSettings",
           "MEASURE_OPTIONS", "MeasureConfig",
           "ModelConfig", "ObjectiveConfig", "OptimizerConfig", "Option", "OutputConfig", "ScheduleError",
           "ShardingConfig", "TrainConfig", "ValidationConfig", "derived_seed", "option_named", "read_config_file"]
