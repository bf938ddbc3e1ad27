"""The model family: the built-in models, the Hugging Face adapter, and how a model is built.

``builtin``     the GPT, the digits conv net and the branchy MLP (``model=gpt`` and friends)
``hf``          the Hugging Face adapter: transformers models, trained exactly (``model=hf_causal_lm``)
``construct``   construction on the meta device and materialisation shard by shard
``pretrained``  ``model.pretrained=DIR`` read slice by slice into each rank's shards
``export``      weights out as safetensors files, tensor by tensor

``dist_trainer.models.GPT`` (and the other built-ins) stay importable from here: configurations name them.
``dist_trainer.hf.models`` remains as the adapter's old path, for configurations and checkpoints that name it.
"""

from .builtin import IGNORE_INDEX, GPT, BranchyMLP, DigitsConvNet

__all__ = ["GPT", "DigitsConvNet", "BranchyMLP", "IGNORE_INDEX"]
