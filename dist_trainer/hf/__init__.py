"""Hugging Face adapters: transformers models, text files read with datasets, tokenizers.

Everything here imports ``transformers``, ``datasets`` or ``tokenizers`` lazily or
at module level of its own submodule, so the rest of the package works without
the ``[hf]`` extra.
"""
