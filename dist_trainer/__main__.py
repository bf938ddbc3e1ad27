"""Entry point: ``torchrun ... -m dist_trainer [overrides]`` or ``python -m dist_trainer``.

Hydra stops here: the composed config is checked against the dataclass schema
and handed on as a plain ``Config``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from . import distributed
from .checkpoint import CheckpointError
from .config import Config, ConfigError
from .parallel import ConsistencyError
from .precision import LossScaleError
from .signals import EXIT_REQUEUE, Preempted
from .trainer import NonFiniteError

# Every rank runs Hydra on its own: the run directory must be keyed on something
# all ranks share (the torchrun run id), never on the clock.
OmegaConf.register_new_resolver("dt_run_id", distributed.run_id, replace=True)
OmegaConf.register_new_resolver("dt_rank", distributed.rank, replace=True)
# Only rank 0 writes Hydra's .hydra/ record of the config.
OmegaConf.register_new_resolver("dt_output_subdir", lambda: ".hydra" if distributed.rank() == 0 else None,
                                replace=True)
ConfigStore.instance().store(name="dist_trainer_schema", node=Config)

log = logging.getLogger("dist_trainer")


def _console_on_main_only() -> None:
    """Ranks other than 0 keep their own log file but stay off the console."""
    if distributed.rank() != 0:
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                root.removeHandler(handler)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    from .run import train  # torch is imported after Hydra has parsed the command line

    _console_on_main_only()
    try:
        cfg: Config = OmegaConf.to_object(dict_cfg)
    except MissingMandatoryValue as err:  # e.g. model=custom without model._target_
        log.error("%s must be set, e.g. %s=my_pkg.module.Name", err.full_key, err.full_key)
        sys.exit(2)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if cfg.plan.only:
            from .plan import plan_report

            print(plan_report(cfg, cfg.plan.world_size or distributed.world_size()))
            return
        train(cfg, run_dir)
    except (ConfigError, LossScaleError, NonFiniteError, ConsistencyError, CheckpointError) as err:
        log.error("%s", err)
        sys.exit(2)
    except Preempted as err:
        log.warning("%s", err)
        sys.exit(EXIT_REQUEUE)


if __name__ == "__main__":
    main()
