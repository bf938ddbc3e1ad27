"""The run's health: who hung, who lags, and one clear error whichever rank fails first.

    store.py       a client of torchrun's rendezvous store, in this attempt's namespace;
                   claims ("the first rank to ask"), each rank's identity and heartbeat
    console.py     an error shown once on the console and named in torchrun's summary
    watchdog.py    dist.step_timeout_s: a hung step (or evaluation, checkpoint, collective)
                   ends the run in seconds, names the ranks that did not arrive, and
                   leaves every responding rank's stacks in its log
    stragglers.py  the slowest and fastest rank's data wait and compute in each step,
                   and a warning naming a rank that lags the median

Nothing here imports the trainer: run.py hands it the step, the phase and the times.
"""
