"""``Exact``: a tensor a batch carries to the loss that must keep its dtype through the model's forward.

FSDP2 casts every floating tensor among a root module's forward inputs to its parameters' dtype (the master
modes' bf16, ``MixedPrecisionPolicy.cast_forward_inputs``), walking dicts, lists, tuples and dataclasses. A
float64 log-probability or advantage would arrive rounded to bf16's 3 significant digits. It does not look inside
this object: what it holds reaches the objective as it was made.
"""

from __future__ import annotations

import torch


class Exact:
    """One tensor, opaque to the forward's input casts (and to ``run.to_device``: ``to`` moves it)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def to(self, device: torch.device) -> torch.Tensor:
        return self.tensor.to(device)

    def __getstate__(self) -> torch.Tensor:  # DataLoader workers pickle batches
        return self.tensor

    def __setstate__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
