"""``logger=[...,wandb]``: a Weights & Biases run; ``logging.wandb.*`` or the WANDB_* variables wandb reads itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional


class WandbRun:
    name = "wandb"

    def __init__(self, cfg: Any, run_dir: Path, default_name: str):
        self.cfg, self.run_dir, self.default_name = cfg, run_dir, default_name
        self.run = None

    def start(self, resume_id: Optional[str]) -> str:
        import wandb

        c = self.cfg
        # None leaves a key to wandb, which reads WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE, ... itself.
        self.run = wandb.init(project=c.project, entity=c.entity, name=c.name or self.default_name,
                              tags=list(c.tags) if c.tags else None, group=c.group, mode=c.mode,
                              dir=str(self.run_dir), id=resume_id, resume="allow" if resume_id else None,
                              settings=wandb.Settings(console="off", x_disable_stats=True))
        return self.run.id

    def config(self, flat: Dict[str, Any], summary: Dict[str, Any]) -> None:
        self.run.config.update(flat, allow_val_change=True)
        for key, value in summary.items():
            self.run.summary[f"plan/{key}"] = value

    def log(self, values: Dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def artifacts(self, paths: List[Path]) -> None:
        if not paths:
            return
        import wandb

        artifact = wandb.Artifact(f"outputs-{self.run.id}", type="outputs")
        for path in paths:
            if path.is_dir():
                artifact.add_dir(str(path), name=path.name)
            else:
                artifact.add_file(str(path), name=path.name)
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        self.run.finish()
