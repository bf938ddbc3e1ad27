"""Kept for configurations and checkpoints that name ``dist_trainer.hf.chat.hf_chat``: it lives in data/hf_chat.py."""

from ..data.hf_chat import (BATCH_CONVERSATIONS, CACHE_VERSION, FORMATS, ROLES, TRAIN_ON, ChatTemplate,  # noqa: F401
                            Columns, Conversations, PackedConversations, encode, hf_chat, pack, read_conversations)
