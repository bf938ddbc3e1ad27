"""Entry point: ``torchrun ... -m dist_trainer [overrides]`` or ``python -m dist_trainer``.

Hydra stops here: the composed config is checked against the dataclass schema
and handed on as a plain ``Config``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from . import distributed
from .checkpoint import CheckpointError, CheckpointWriteError
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


class _Tee(io.TextIOBase):
    """Keeps a copy of what is written, and passes it on to ``out`` (None: keeps it only)."""

    def __init__(self, out: Optional[TextIO]):
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        if self.out is not None:
            self.out.write(text)
        return len(text)

    def flush(self) -> None:
        if self.out is not None:
            self.out.flush()


_STDERR: dict = {}  # the real stderr while Hydra composes the config, before main() runs
HYDRA_ERROR_GRACE_S = 10.0


def _record_for_torchrun(err: BaseException) -> None:
    """Write the error where torchrun reads it, so that its closing summary names the cause.

    torchrun gives each worker TORCHELASTIC_ERROR_FILE; without it (a plain
    process) there is nothing to write.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # torch.distributed.elastic's error-file format. These errors are expected and say what to
    # change, so the "traceback" torchrun prints is the message itself, not a call stack.
    message = f"{type(err).__name__}: {err}"
    record = {"message": {"message": message, "extraInfo": {"py_callstack": message,
                                                            "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(record, f)
    except OSError:
        pass  # the error itself was logged; a summary without it is no reason to fail differently


def entry() -> None:
    """Hydra's own errors (an unknown key, a bad override) are printed by rank 0 alone, and recorded for torchrun.

    Until main() runs, stderr goes through a tee: rank 0 prints it, the others
    only keep it. If Hydra stops before main(), what it printed is the error.
    """
    real = sys.stderr
    tee = _Tee(real if distributed.rank() == 0 else None)
    _STDERR["real"] = real
    sys.stderr = tee
    try:
        main()
    except SystemExit as exit_:
        if "real" in _STDERR and exit_.code not in (0, None):  # Hydra stopped before main()
            lines = [line.strip() for line in tee.kept.getvalue().splitlines()
                     if line.strip() and "HYDRA_FULL_ERROR" not in line]
            _record_for_torchrun(ConfigError(" ".join(lines[:3]) if lines else f"exit status {exit_.code}"))
            if distributed.rank() != 0:
                # torchrun stops every worker once one exits: leave rank 0 the time to print the error
                # (the same one: it comes from the same command line) before this rank's exit.
                time.sleep(HYDRA_ERROR_GRACE_S)
        raise
    finally:
        sys.stderr = real
        _STDERR.clear()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    if "real" in _STDERR:  # our code runs from here: stderr as it was
        sys.stderr = _STDERR.pop("real")
    from .run import train  # torch is imported after Hydra has parsed the command line

    _console_on_main_only()
    try:
        cfg: Config = OmegaConf.to_object(dict_cfg)
    except MissingMandatoryValue as err:  # e.g. model=custom without model._target_, data=tokens without data.path
        example = "my_pkg.module.Name" if err.full_key.endswith("_target_") else "..."
        message = f"{err.full_key} must be set, e.g. {err.full_key}={example}"
        log.error("%s", message)
        _record_for_torchrun(ConfigError(message))
        sys.exit(2)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        if cfg.plan.only:
            from .plan import plan_report

            print(plan_report(cfg, cfg.plan.world_size or distributed.world_size(),
                              cfg.plan.nproc_per_node or distributed.launched_local_world_size(),
                              run_dir / "plan.json"))
            return
        train(cfg, run_dir)
    except (ConfigError, LossScaleError, NonFiniteError, ConsistencyError, CheckpointError,
            CheckpointWriteError) as err:
        log.error("%s", err)
        _record_for_torchrun(err)
        sys.exit(2)
    except Preempted as err:
        log.warning("%s", err)
        sys.exit(EXIT_REQUEUE)


if __name__ == "__main__":
    entry()
