"""dist_trainer: exact gradient accumulation and mixed precision on DDP."""

__version__ = "0.1.0"
