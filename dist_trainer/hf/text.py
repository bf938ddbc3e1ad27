"""Kept for configurations and checkpoints that name ``dist_trainer.hf.text.hf_text``: it lives in data/hf_text.py."""

from ..data.hf_text import (CACHE_VERSION, EXTENSIONS, EXTRA, FORMATS, OUTCOMES, TASKS, CausalText,  # noqa: F401
                            MaskedText, Names, Sources, agreed, build_cache, cache_key, cache_root, check_common,
                            files_key, hf_text, load_table, mask_tokens, read_documents, resolve_files)
