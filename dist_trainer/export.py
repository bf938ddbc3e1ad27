"""``python -m dist_trainer.export CHECKPOINT_DIR OUT_DIR``: a checkpoint as a Hugging Face model directory."""

from .hf.export import main

if __name__ == "__main__":
    main()
