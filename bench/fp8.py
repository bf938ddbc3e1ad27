"""The float8 precision modes on 2 CPU ranks: step time and model state against bf16-master, and plan mode's line
for each (how many linears convert).

    python bench/fp8.py                          # ddp and fsdp, 2-3 minutes on 2 shared cores
    python bench/fp8.py --strategies ddp --timed 10
    python bench/fp8.py --json fp8.json

FLOAT8 IS EMULATED HERE. A CPU has no float8 matmuls: torchao's ``Float8Linear`` (``precision.fp8.emulate: auto``)
casts to float8 and back and multiplies in a wider type, so the numbers are float8's and the speed is not. The step
times below measure the emulation's cost on this CPU, never a speed of float8: on a GPU with float8 tensor cores
(compute capability 8.9 and above) the same modes run real float8 matmuls; bench/gpu.py holds those rows.

What runs: the default job (conf/model/gpt.yaml: 4 blocks x 128 wide, data char_text, global 64 x 64 bytes, micro
16, accum 2) on 2 gloo ranks, under ddp and fsdp, in each precision: fp32, bf16-master (the ratios' base),
fp8-rowwise, fp8-rowwise-gw-hp, fp8-tensorwise and fp8-mxfp8 over ``precision.fp8.compute=bf16`` (the default:
bf16 weights, autocast, FP32 masters), fp8-rowwise over ``compute=fp32``, and under fsdp fp8-tensorwise with
FSDP2's float8 all-gather (``precision.fp8.all_gather=true``), whose all-gather bytes a step are printed beside
the others' and plan mode's. Every mode is built once, as
``dist_trainer.run.build`` builds a run, in the same two processes, and its steps are taken by
``Trainer.train_step`` on the run's own batches: ``--warmup`` untimed steps each, then ``--timed`` steps each, the
modes taking turns step by step (another job's burst on the shared cores then falls on every mode alike). A step's
time is the slowest rank's wall time of ``train_step``, the figure its median over the timed steps, as a ratio to
bf16-master under the same strategy in the same run. ``state_mb`` is the step outcome's (parameters, gradients,
optimizer state, FP32 masters; largest rank) beside plan mode's prediction. "emulated" is read from the built
model's ``Float8Linear`` modules (their ``config.emulate``) and ``MXFP8Linear`` modules (their kernel preference),
not assumed.

Plan mode's line (``dist_trainer.plan.plan_report``, as ``python -m dist_trainer precision=... plan.only=true``
prints it) is printed for each float8 mode first, in this process, before any rank starts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import compose, machine_description  # noqa: E402

WORLD = 2
BASE_MODE = "bf16-master"
PRECISIONS = {  # name: the overrides that choose it (conf/precision/*.yaml and precision.fp8's keys)
    "fp32": ["precision=fp32"],
    "bf16-master": ["precision=bf16-master"],
    "fp8-rowwise": ["precision=fp8-rowwise"],
    "fp8-rowwise-gw-hp": ["precision=fp8-rowwise-gw-hp"],
    "fp8-tensorwise": ["precision=fp8-tensorwise"],
    "fp8-mxfp8": ["precision=fp8-mxfp8"],
    "fp8-rowwise, compute fp32": ["precision=fp8-rowwise", "precision.fp8.compute=fp32"],
    "fp8-tensorwise, float8 all-gather": ["precision=fp8-tensorwise", "precision.fp8.all_gather=true"],
}
FSDP_ONLY = {"fp8-tensorwise, float8 all-gather"}  # FSDP's all-gather: nothing to gather under ddp
STRATEGIES = {"ddp": [], "fsdp": ["dist.strategy=fsdp"]}


def modes(strategies: list) -> dict:
    """'strategy / precision': overrides, bf16-master's run among them under each strategy (the ratios' base)."""
    return {f"{s} / {p}": STRATEGIES[s] + PRECISIONS[p] for s in strategies for p in PRECISIONS
            if s == "fsdp" or p not in FSDP_ONLY}


def plan_lines() -> dict:
    """Plan mode's float8 line for each float8 mode (2 ranks, ddp; the line does not depend on the strategy)."""
    from dist_trainer.plan import plan_report

    lines = {}
    for name, keys in PRECISIONS.items():
        if "fp8" in name and name not in FSDP_ONLY:
            report = plan_report(compose(keys), WORLD)
            lines[name] = next(line.strip() for line in report.splitlines() if "linears in float8" in line)
    return lines


class Mode(common.Mode):
    """One mode's run, and what float8 became in it."""

    def __init__(self, overrides: list, env) -> None:
        super().__init__(overrides, env, WORLD)

    def float8(self) -> tuple:
        """(linears converted to Float8Linear or MXFP8Linear, how many of them emulate float8) in the built
        model."""
        from dist_trainer.fp8 import converted

        linears = [self.trainer.module.get_submodule(name) for name in converted(self.trainer.module)]
        return len(linears), sum(bool(m.config.emulate) if hasattr(m, "config") else
                                 m.kernel_preference.name == "EMULATED" for m in linears)


def _rank(rank: int, store: str, out: str, strategies: list, warmup: int, timed: int) -> None:
    from dist_trainer import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    env = distributed.init("cpu")  # the group above, as a launcher's
    runs = {name: Mode(keys, env) for name, keys in modes(strategies).items()}
    for run in runs.values():
        for _ in range(warmup):
            run.train_step()
    steps = common.take_turns(runs, timed, 5, rank)
    record = {}
    for name, run in runs.items():
        converted, emulated = run.float8()
        record[name] = {"step": common.slowest(steps[name]), "loss": run.last.loss, "state_mb": run.last.state_mb,
                        "plan_state_mb": run.plan_state_mb, "steps": run.step, "float8_linears": converted,
                        "emulated_linears": emulated, "all_gather_bytes": run.last.comm.get("all_gather_bytes", 0),
                        "plan_all_gather_bytes": run.plan_step.get("all_gather_bytes", 0)}
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    del runs
    distributed.shutdown(env)
    dist.barrier()
    dist.destroy_process_group()


def step_part(strategies: list, warmup: int, timed: int) -> dict:
    print(f"\nSTEP: default GPT, 2 gloo ranks, global 64 x 64 bytes, micro 16, accum 2; {warmup} untimed, then "
          f"{timed} timed steps a mode, the modes taking turns step by step; median of the slowest rank's times. "
          "Float8 is EMULATED by torchao on this CPU: the times are the emulation's, not float8's speed\n",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-fp8-") as tmp:
        out = os.path.join(tmp, "record.json")
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), out, strategies, warmup, timed), nprocs=WORLD,
                           start_method="spawn")
        record = json.loads(Path(out).read_text())
    print(f"\n| strategy | precision | float8 linears (emulated) | step (ms) | vs {BASE_MODE} | state_mb (plan) | "
          f"vs {BASE_MODE} | FSDP all-gather MiB a step (plan) | loss at step {warmup + timed} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, rec in record.items():
        strategy, precision = name.split(" / ")
        base = record[f"{strategy} / {BASE_MODE}"]
        step, base_step = statistics.median(rec["step"]), statistics.median(base["step"])
        float8 = f"{rec['float8_linears']} ({rec['emulated_linears']})" if rec["float8_linears"] else "0"
        print(f"| {strategy} | {precision} | {float8} | {step * 1e3:.1f} | {step / base_step:.2f}x | "
              f"{rec['state_mb']:.3f} ({rec['plan_state_mb']:.3f}) | {rec['state_mb'] / base['state_mb']:.2f}x | "
              f"{rec['all_gather_bytes'] / 2**20:.3f} ({rec['plan_all_gather_bytes'] / 2**20:.3f}) | "
              f"{rec['loss']:.4f} |")
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps a mode, first")
    parser.add_argument("--timed", type=int, default=15, help="timed steps a mode, the modes in turn")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"--strategies: unknown {sorted(unknown)}; choose from {sorted(STRATEGIES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    began = time.perf_counter()
    print(machine_description(), flush=True)
    print("\nPLAN MODE (python -m dist_trainer precision=... plan.only=true, 2 ranks):", flush=True)
    lines = plan_lines()
    for name, line in lines.items():
        print(f"  {name}: {line}", flush=True)
    out = {"plan": lines, "step": step_part(strategies, args.warmup, args.timed)}
    print(f"\ntotal {time.perf_counter() - began:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
