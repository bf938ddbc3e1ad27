"""The last module the preloaded server imports: it moves every object the imports made out of the collector's
reach (``gc.freeze``).

torch, transformers, Hydra and the rest leave about a million objects behind. Without this each
``gc.collect()`` in a forked case (``run_jobs`` calls one between jobs, so that a DDP or FSDP wrapper goes
before the next job builds its own) walks them all: 0.2 s a call here, two thirds of a small job's time, and
it writes to every page it walks, so the fork's copy-on-write pages are copied. Frozen objects are never
collected, so only what is garbage at import time could leak, and the collect before the freeze takes it.
"""

import gc

gc.collect()
gc.freeze()
