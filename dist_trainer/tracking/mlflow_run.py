"""``logger=[...,mlflow]``: an MLflow run; ``logging.mlflow.*`` or MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

PARAMS_PER_BATCH = 100  # MLflow's limit for one log_batch
PARAM_CHARS = 6000  # and for one parameter's value


class MlflowRun:
    name = "mlflow"

    def __init__(self, cfg: Any, default_name: str):
        # MLflow retries an unreachable server for minutes by default; the tracking thread would sit on
        # a dead server's backlog until the run's end waits it out. The user's own settings win.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.tracking import MlflowClient

        self.cfg, self.default_name = cfg, default_name
        self.client = MlflowClient(tracking_uri=cfg.tracking_uri)  # None: MLFLOW_TRACKING_URI
        self.run_id: Optional[str] = None

    def start(self, resume_id: Optional[str]) -> str:
        if resume_id is not None:
            self.client.update_run(resume_id, status="RUNNING")
            self.run_id = resume_id
            return resume_id
        name = self.cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dist_trainer"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=self.cfg.run_name or self.default_name)
        self.run_id = run.info.run_id
        return self.run_id

    def config(self, flat: Dict[str, Any], summary: Dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:PARAM_CHARS]) for key, value in flat.items()]
        params += [Param(f"plan/{key}", str(value)[:PARAM_CHARS]) for key, value in summary.items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log(self, values: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def artifacts(self, paths: List[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            else:
                self.client.log_artifact(self.run_id, str(path))

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
