"""``python -m dist_trainer.evaluate MODEL_DIR CHATS.jsonl``: answer loss and exact match (dist_trainer.hf.evaluate)."""

from .hf.evaluate import main

if __name__ == "__main__":
    main()
