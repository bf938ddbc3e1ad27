"""Post-training with preferences and rewards: ``task=dpo`` and ``task=grpo`` (``rl.*``), a wing of its own.

``checks.py`` holds the keys' checks (run by ``dist_trainer.validation``); ``dpo.py`` the DPO objective (the loss
over a micro-batch of pairs against a reference, its figures) and the objective seam the trainer calls;
``grpo.py`` the GRPO family's objective (advantages, the clipped surrogate, the aggregations over the step),
``rollout.py`` its keyed sampling, ``rewards.py`` its rewards; ``plan.py`` what each adds to plan mode;
``precompute.py`` DPO's precomputed reference; ``publish.py`` and ``transfer.py`` hand the policy's weights to an
inference server during training (``rl.publish``, any task).
"""

from .dpo import DPO, NoObjective, build_objective, objective_of

__all__ = ["DPO", "NoObjective", "build_objective", "objective_of"]
