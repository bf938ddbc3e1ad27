"""``python -m dist_trainer.tokenizer`` (the command users run), and the old import path: data/train_tokenizer.py."""

from .data.train_tokenizer import SAMPLE_BATCHES, main, train  # noqa: F401

if __name__ == "__main__":
    main()
