"""The data family: the order in which samples reach ranks and micro-batches, the loaders, and each dataset.

``loader``           the sample order (``StepPlan``, ``SampleOrder``), the training and evaluation loaders,
                     ``build_dataset`` (what ``data._target_`` names, built)
``builtin``          the built-in datasets (``data=char_text``, ``digits``; ``regression`` for tests)
``tokens``           token files, memory-mapped (``data=tokens``)
``prepare``          text files to token files (``python -m dist_trainer.prepare``)
``tokenizer``        the one tokenizer loader: bytes, or a ``tokenizers`` file; BPE training
``train_tokenizer``  ``python -m dist_trainer.tokenizer``: a BPE tokenizer trained on local files
``hf_text``          ``data=hf_text``: local text files read with Hugging Face ``datasets``
``streaming``        ``data.streaming=true``: hf_text's files tokenized by a reader thread as the run reads
``hf_chat``          ``data=hf_chat``: conversations, the loss on the answers only
``hf_preference``    ``data=hf_preference``: preference pairs for DPO, a batch of the chosen rows then the rejected
``mixture``          ``data=blend``'s arithmetic: weights and schedules, each source's count per step, its keys' checks
``blend``            ``data=blend``: the sources end to end, and their order per step (``BlendPlan``)

Nothing here imports the run, the step or a strategy; the ``hf_*`` modules and ``tokenizer`` import
``datasets``, ``tokenizers`` and ``jinja2`` at their own level or lazily, so the rest works without the
``[hf]`` extra. ``dist_trainer.datasets``, ``tokens``, ``prepare``, ``tokenizer`` and ``hf.text``, ``hf.chat``,
``hf.tokenizer`` remain as the old paths, for configurations and checkpoints that name them.
"""

from .loader import (SampleOrder, StepPlan, TrainLoader, Window, build_dataset, collate_of, epoch_batches,
                     eval_loader, hash_key)
from .blend import Blend, BlendPlan, plan_for

__all__ = ["StepPlan", "SampleOrder", "Window", "TrainLoader", "build_dataset", "epoch_batches", "eval_loader",
           "collate_of", "hash_key", "Blend", "BlendPlan", "plan_for"]
