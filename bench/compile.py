"""torch.compile on CPU: compiled / eager step time, compilation seconds, recompilations (2 ranks).

    python bench/compile.py                # ddp and fsdp, eager and compiled, 2 rounds, about 6 minutes
    python bench/compile.py --rounds 1 --steps 110

Every run is ``torchrun -m dist_trainer`` on the default GPT (4 blocks x 128 wide,
block 64, 2 ranks x micro 16 x accum 2, fp32, AdamW) for ``--steps`` optimizer
steps: with the default 110 the run crosses the end of the first epoch (103
steps, the last one short: 26 samples, 13 a rank) and evaluates at step 100
and at the end. Each compiled run starts with an empty inductor cache
(``TORCHINDUCTOR_CACHE_DIR`` in a fresh directory), so its compilation is
measured cold.

Per run, from metrics.jsonl: the median ``step_time_s`` after ``--warmup`` steps;
compilation = step 1's time minus that median (step 1 compiles); the
recompilations (``recompiles`` at the last step, compilations after step 1).
Strategies and compile settings alternate within each round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, run_dist_trainer  # noqa: E402

RUNS = {(strategy, compiled): [f"dist.strategy={strategy}", f"trainer.compile={str(compiled).lower()}"]
        for strategy in ("ddp", "fsdp") for compiled in (False, True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    print(machine_description(), flush=True)
    results = {key: [] for key in RUNS}
    for rnd in range(1, args.rounds + 1):
        for key, overrides in RUNS.items():
            recs = run_dist_trainer(overrides + ["trainer.eval_every=100", "trainer.eval_batches=2"], args.steps,
                                    fresh_inductor_cache=True)
            median = statistics.median(r["step_time_s"] for r in recs[args.warmup:])
            row = {"median": median, "compile_s": recs[0]["step_time_s"] - median, "loss": recs[-1]["loss"],
                   "recompiles": recs[-1].get("recompiles"), "epochs": recs[-1]["epoch"],
                   "evals": sum("eval_loss" in r for r in recs)}
            results[key].append(row)
            print(f"round {rnd} {key[0]} compile={key[1]!s:5} median {median * 1e3:6.1f} ms/step, step 1 "
                  f"{recs[0]['step_time_s']:6.1f} s, recompiles {row['recompiles']}, epoch at the end {row['epochs']}, "
                  f"{row['evals']} evaluations, loss {row['loss']:.6f}", flush=True)
    print("\n| strategy | compile | median step (ms) | compiled / eager | compilation (s) | recompilations after step 1 | loss at the last step |")
    print("|---|---|---|---|---|---|---|")
    for (strategy, compiled), rows in results.items():
        med = statistics.median(r["median"] for r in rows)
        eager = statistics.median(r["median"] for r in results[(strategy, False)])
        comp = f"{statistics.median(r['compile_s'] for r in rows):.1f}" if compiled else "-"
        recompiles = ", ".join(str(r["recompiles"]) for r in rows) if compiled else "-"
        print(f"| {strategy} | {'on' if compiled else 'off'} | {med * 1e3:.1f} | {med / eager:.3f} | {comp} | "
              f"{recompiles} | {rows[-1]['loss']:.6f} |")


if __name__ == "__main__":
    main()
