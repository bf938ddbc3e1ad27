"""``torchrun ... -m dist_trainer [overrides]`` and ``python -m dist_trainer [overrides]``.

The entry point lives in dist_trainer.cli, a module with a name of its own: a
submitit task (Slurm sweeps) is handed ``main`` by reference and imports that
module, which registers the resolvers and learns the task's rank; a function of
``__main__`` would travel by value, without them.
"""

from .cli import entry

if __name__ == "__main__":
    entry()
