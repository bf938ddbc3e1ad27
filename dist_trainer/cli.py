"""The command line: ``torchrun ... -m dist_trainer [overrides]`` or ``python -m dist_trainer``.

Hydra stops here: the composed config is checked against the dataclass schema
and handed on as a plain ``Config``.
"""

from __future__ import annotations

import io
import logging
import os
import sys
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
from .health.console import console_on_main_only, report_error
from .parallel import ConsistencyError
from .precision import LossScaleError
from .rl.publish import PublishError
from .signals import EXIT_REQUEUE, Preempted, pass_on
from .trainer import NonFiniteError

# A submitit task (hydra/launcher=submitit_slurm) imports this module to run main(): it learns
# its rank here, before Hydra names its log file (rank<N>.log) and lets rank 0 write .hydra/.
distributed.adopt_submitit_task()
# Every rank runs Hydra on its own: the run directory must be keyed on something
# all ranks share (the torchrun run id), never on the clock.
OmegaConf.register_new_resolver("dt_run_id", distributed.run_id, replace=True)
OmegaConf.register_new_resolver("dt_rank", distributed.rank, replace=True)
# Only rank 0 writes Hydra's .hydra/ record of the config.
OmegaConf.register_new_resolver("dt_output_subdir", lambda: ".hydra" if distributed.rank() == 0 else None,
                                replace=True)
# The global batch: the given number of samples, but task=grpo's, which is its prompts x their completions.
OmegaConf.register_new_resolver(
    "dt_global_batch", lambda given, task, prompts, group: prompts * group if task == "grpo" else given, replace=True)
ConfigStore.instance().store(name="dist_trainer_schema", node=Config)

log = logging.getLogger("dist_trainer")


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


def entry() -> None:
    """Hydra's own errors (an unknown key, a bad override) are printed once, by the first rank to fail.

    Until main() runs, stderr goes through a tee that only keeps what is
    written. Once main() runs, rank 0 passes on what was kept (warnings); if
    Hydra stops before main(), what it printed is the error, and the first rank
    to fail prints it (health.console).
    """
    real = sys.stderr
    tee = _Tee(None)
    _STDERR.update(real=real, tee=tee)
    sys.stderr = tee
    try:
        main()
    except SystemExit as exit_:
        if "real" in _STDERR and exit_.code not in (0, None):  # Hydra stopped before main()
            sys.stderr = real
            kept = tee.kept.getvalue()
            lines = [line.strip() for line in kept.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
            report_error("ConfigError", " ".join(lines[:3]) if lines else f"exit status {exit_.code}",
                         printed=kept)
        elif "real" in _STDERR and distributed.rank() == 0:  # --help, --cfg: Hydra's output, as it was
            real.write(tee.kept.getvalue())
        raise
    finally:
        sys.stderr = real
        _STDERR.clear()


def run_job(dict_cfg: DictConfig) -> None:
    """One run of the composed config: Hydra's task function (``main`` is it under @hydra.main)."""
    if "real" in _STDERR:  # our code runs from here: stderr as it was, with what Hydra wrote to it
        sys.stderr = _STDERR.pop("real")
        if distributed.rank() == 0:
            sys.stderr.write(_STDERR.pop("tee").kept.getvalue())
    from .run import train  # torch is imported after Hydra has parsed the command line

    console_on_main_only()
    try:
        cfg: Config = OmegaConf.to_object(dict_cfg)
    except MissingMandatoryValue as err:  # e.g. model=custom without model._target_, data=tokens without data.path
        example = "my_pkg.module.Name" if err.full_key.endswith("_target_") else "..."
        message = f"{err.full_key} must be set, e.g. {err.full_key}={example}"
        report_error("ConfigError", message)
        _stop(ConfigError(message))
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
            CheckpointWriteError, PublishError) as err:
        report_error(type(err).__name__, str(err))
        _stop(err)
    except Preempted as err:  # said by dist_trainer.run.train, on every rank before any left
        pass_on(err.signum)  # submitit's handler requeues the job (rank 0)
        sys.exit(EXIT_REQUEUE)


def _stop(err: Exception) -> None:
    """Exit 2 with the error already printed; a submitit task raises it instead.

    Hydra's job runner keeps what a task raises in the job's result, which
    submitit sends back: the sweep's command then fails with this error. A task
    that exits leaves no result, and the command can only say that the job
    produced none (or, on a cluster without job accounting, wait for it).
    """
    if os.environ.get("SUBMITIT_EXECUTOR"):
        raise err
    sys.exit(2)


# Not a decorator: a launcher that ships the task function to another process (submitit)
# pickles it by name, so run_job must stay reachable under its own name in this module.
main = hydra.main(config_path="conf", config_name="config", version_base="1.3")(run_job)
