"""Hugging Face outputs: a trained model back to ``hf_model/`` (``export``) and its answers measured (``evaluate``).

The adapter itself is ``models/hf.py``; text, chats and the tokenizer loader are in ``data/``. ``models``,
``text``, ``chat`` and ``tokenizer`` here are their old paths, kept for configurations and checkpoints that
name them. Everything imports ``transformers``, ``datasets`` or ``tokenizers`` lazily or at module level of
its own submodule, so the rest of the package works without the ``[hf]`` extra.
"""
