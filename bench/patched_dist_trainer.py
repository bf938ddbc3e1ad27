"""dist_trainer with one diagnostic monkeypatch, for bench/diagnose.py only (never the benchmark).

    torchrun --standalone --nproc_per_node=2 bench/patched_dist_trainer.py PATCH [hydra overrides...]

Applies PATCH inside this process, then runs ``python -m dist_trainer`` as is.
Patches (each tests one hypothesis about where time goes; none is a fix to
ship as it stands):

* ``none``: no patch (checks that this launcher itself costs nothing);
* ``no_comm_hook``: DDP keeps its built-in C++ all-reduce instead of
  dist_trainer's Python counting hook (allreduces/allreduce_bytes then read 0);
* ``gc_freeze``: ``gc.freeze()`` after the parts are built, so the cyclic
  garbage collector no longer rescans Hydra's and the framework's long-lived
  objects on each collection;
* ``gc_off``: the cyclic garbage collector disabled after the build.
"""

from __future__ import annotations

import gc
import runpy
import sys

PATCHES = ("none", "no_comm_hook", "gc_freeze", "gc_off")


def apply(patch: str) -> None:
    import dist_trainer.run as run

    if patch == "no_comm_hook":
        import dist_trainer.parallel as parallel

        parallel.count_allreduces = lambda ddp, reduce, sent=None: parallel.AllreduceCounter(reduce)
    elif patch in ("gc_freeze", "gc_off"):
        build = run.build

        def build_then_gc(*args, **kwargs):
            parts = build(*args, **kwargs)
            gc.collect()
            if patch == "gc_freeze":
                gc.freeze()
            else:
                gc.disable()
            return parts

        run.build = build_then_gc
    elif patch != "none":
        raise SystemExit(f"unknown patch {patch!r}; choose from {PATCHES}")


def main() -> None:
    patch = sys.argv.pop(1)
    apply(patch)
    sys.argv[0] = "dist_trainer"
    runpy.run_module("dist_trainer", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
