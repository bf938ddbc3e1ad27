"""The model family: the built-in models, the Hugging Face adapter, and how a model is built.

``builtin``     the GPT, the digits conv net and the branchy MLP (``model=gpt`` and friends)
``construct``   construction on the meta device and materialisation shard by shard

``dist_trainer.models.GPT`` (and the other built-ins) stay importable from here: configurations name them.
"""

from .builtin import IGNORE_INDEX, GPT, BranchyMLP, DigitsConvNet

__all__ = ["GPT", "DigitsConvNet", "BranchyMLP", "IGNORE_INDEX"]
