"""The Hydra config groups, a package so that Hydra finds them from dist_trainer.cli (pkg://dist_trainer.conf)."""
