"""Typed configuration: the schema and the shapes derived from it (the mesh, the batch plan).

Config is the ground: this package imports nothing of dist_trainer outside itself, so every layer may import it
and none of it knows a feature. Below the entry point nothing sees Hydra; ``dist_trainer.validation.validate``
runs each feature's checks on the composed ``Config`` and derives the ``BatchPlan`` before any tensor exists.
"""

from .schema import (ADVANTAGE_ESTIMATORS, ADVANTAGE_SCALES, KL_ESTIMATORS, LOSS_AGG_ALIASES, LOSS_AGGS,
                     DPO_LOSSES, REFERENCES, TASKS, DPOConfig, RLConfig, ACCUM_SYNCS, LOADER_KEYS, LOGGER_PACKAGES, LOGGERS, LR_SCALINGS, NONFINITE_POLICIES, OPTIMIZERS,
                     PP_SCHEDULES, PRECISIONS, RESHARDS, SCHEDULES, STRATEGIES, TP_STYLES, BatchConfig, Config,
                     ConfigError, CPConfig, DistConfig, EPConfig, Fp8Config, FSDPConfig, LoggingConfig,
                     LossScaleConfig, MlflowConfig, MuonConfig, OptimConfig, PlanConfig, PPConfig, PrecisionConfig,
                     TPConfig, TrainerConfig, WandbConfig, divisors, logger_names, master_mode, pp_v_shape, require)
from .shapes import MIB, BatchPlan, MeshShape, derive_batch, derive_mesh, mib_text, resolve_reshard, scaled_lr

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ADVANTAGE_SCALES", "KL_ESTIMATORS", "LOSS_AGG_ALIASES", "LOSS_AGGS",
    "DPO_LOSSES", "REFERENCES", "TASKS", "DPOConfig", "RLConfig",
    "ACCUM_SYNCS", "LOADER_KEYS", "LOGGER_PACKAGES", "LOGGERS", "LR_SCALINGS", "NONFINITE_POLICIES", "OPTIMIZERS",
    "PP_SCHEDULES", "PRECISIONS", "RESHARDS", "SCHEDULES", "STRATEGIES", "TP_STYLES", "BatchConfig", "Config",
    "ConfigError", "CPConfig", "DistConfig", "EPConfig", "Fp8Config", "FSDPConfig", "LoggingConfig",
    "LossScaleConfig", "MlflowConfig", "MuonConfig", "OptimConfig", "PlanConfig", "PPConfig", "PrecisionConfig",
    "TPConfig", "TrainerConfig", "WandbConfig", "divisors", "logger_names", "master_mode", "pp_v_shape", "require",
    "MIB", "BatchPlan", "MeshShape", "derive_batch", "derive_mesh", "mib_text", "resolve_reshard", "scaled_lr",
]
