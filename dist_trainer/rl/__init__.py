"""Post-training with preferences: ``task=dpo`` (``rl.*``), a wing of its own.

``checks.py`` holds the keys' checks (run by ``dist_trainer.validation``), ``dpo.py`` the objective: the loss over
a micro-batch of pairs against a reference, and the step's figures it adds to metrics.jsonl; ``publish.py`` hands
the policy's weights to an inference server during training (``rl.publish``, any task).
"""

from .dpo import DPO, NoObjective, build_objective, objective_of

__all__ = ["DPO", "NoObjective", "build_objective", "objective_of"]
