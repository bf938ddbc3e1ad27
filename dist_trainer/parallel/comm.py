"""The collectives a strategy counts for gradients and parameters, by metrics.jsonl key.

Every strategy's ``comm()`` returns each key (0 for a kind it never issues), so
every step's record has the same fields; plan mode predicts the same keys.
"""

COMM_KEYS = ("all_gathers", "all_gather_bytes", "reduce_scatters", "reduce_scatter_bytes",
             "allreduces", "allreduce_bytes")
