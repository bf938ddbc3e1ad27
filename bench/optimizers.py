"""Optimizers on 2 CPU ranks: the train step's and the optimizer step's time, and the state each keeps; then
Muon's Newton-Schulz iteration at GPT-2 small's matrix shapes on one process.

    python bench/optimizers.py                      # both parts, about 2 minutes on 2 cores
    python bench/optimizers.py --part step --timed 60
    python bench/optimizers.py --part ns --iters 10

step: the default job (conf/model/gpt.yaml: 4 blocks x 128 wide, data char_text, fp32, global 64 x 64 bytes,
micro 16, accum 2) on 2 gloo ranks, with each optimizer under ddp and under fsdp: AdamW (FP32 state), AdamW with
``optim.state_dtype=bf16``, Adafactor (``optim=adafactor``; ddp only: fsdp refuses it), Muon in gather mode and in
owner mode (``optim=muon``, ``optim.muon.dist=gather|owner``; under ddp a rank holds its matrices whole, so both
modes orthogonalise every matrix on every rank and gather nothing: the same work, so their difference is the
run's noise). Every mode is built once, as ``dist_trainer.run.build`` builds a run, in the same two processes,
and its steps are taken by ``Trainer.train_step`` on the run's own batches: ``--warmup`` untimed steps each, then
``--timed`` steps each, the modes taking turns step by step (another job's burst on the shared cores then falls
on every mode alike). A step's time is the slowest rank's wall time of ``train_step``; the optimizer's is the
slowest rank's wall time of ``optimizer.step()`` alone (torch's step pre- and post-hooks), Muon's gathers and
scatters included; each figure is the median over the timed steps, as a ratio to AdamW under the same strategy
in the same run. ``state_mb`` is the step outcome's (parameters,
gradients, optimizer state, largest rank) beside plan mode's prediction; "optimizer state" is the bytes of the
tensors in ``optimizer.state`` on the largest rank.

ns: ``dist_trainer.optim.muon.orthogonalise(update, 5, dtype)`` on a random matrix of each of GPT-2 small's hidden
shapes (attention's qkv 768x2304 and output 768x768, the MLP's 768x3072 and 3072x768), fp32 and bf16, in this
process with ``OMP_NUM_THREADS`` threads (1 unless set): the median of ``--iters`` calls after one untimed call.

A CPU with gloo on 2 shared cores measures the optimizers' work against each other, not what a GPU would give:
on a GPU the step's matrix products are far faster and Newton-Schulz's bf16 matmuls run on tensor cores.
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
from common import machine_description  # noqa: E402

WORLD = 2
OPTIMIZERS = {  # name: the overrides that choose it (the config groups a user names: conf/optim/*.yaml)
    "AdamW": [],
    "AdamW, bf16 state": ["optim.state_dtype=bf16"],
    "Adafactor": ["optim=adafactor"],
    "Muon gather": ["optim=muon", "optim.muon.dist=gather"],
    "Muon owner": ["optim=muon", "optim.muon.dist=owner"],
}
STRATEGIES = {"ddp": [], "fsdp": ["dist.strategy=fsdp"]}
REFUSED = {("fsdp", "Adafactor")}  # a ConfigError: torch's Adafactor cannot step DTensor shards
# GPT-2 small's hidden matrices, as (rows, cols) of the update Muon orthogonalises, and how many a layer has
GPT2_SHAPES = ((768, 768), (768, 2304), (768, 3072), (3072, 768))
GPT2_LAYERS = 12
NS_STEPS = 5


def modes() -> dict:
    """'strategy / optimizer': overrides, AdamW first under each strategy (the ratios' base)."""
    return {f"{s} / {o}": STRATEGIES[s] + OPTIMIZERS[o]
            for s in STRATEGIES for o in OPTIMIZERS if (s, o) not in REFUSED}


class Mode(common.Mode):
    """One mode's run, and its optimizer's step times."""

    def __init__(self, overrides: list, env) -> None:
        super().__init__(overrides, env, WORLD)
        self.optimizer_times: list = []
        began = []  # the optimizer's own time, by torch's public step hooks (one pair of perf_counter calls)
        self.trainer.optimizer.register_step_pre_hook(lambda *_: began.append(time.perf_counter()))
        self.trainer.optimizer.register_step_post_hook(
            lambda *_: self.optimizer_times.append(time.perf_counter() - began.pop()))

    def optimizer_state_bytes(self) -> int:
        """Bytes of the tensors in the optimizer's state on this rank (a DTensor's local shard)."""
        tensors = [t for state in self.trainer.optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor)]
        return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)


def _rank(rank: int, store: str, out: str, warmup: int, timed: int) -> None:
    from dist_trainer import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    env = distributed.init("cpu")  # the group above, as a launcher's
    runs = {name: Mode(keys, env) for name, keys in modes().items()}
    for run in runs.values():
        for _ in range(warmup):
            run.train_step()
        run.optimizer_times.clear()
    steps = common.take_turns(runs, timed, 10, rank)
    record = {}
    for name, run in runs.items():
        times = common.slowest(steps[name] + run.optimizer_times)  # each step's slowest rank
        record[name] = {"step": times[:timed], "optimizer": times[timed:], "loss": run.last.loss,
                        "state_mb": run.last.state_mb, "step_peak_state_mb": run.last.step_peak_state_mb,
                        "steps": run.step, "comm": run.last.comm}
    for name, run in runs.items():
        record[name]["plan_state_mb"] = run.plan_state_mb
        record[name]["optimizer_state_mb"] = common.slowest([run.optimizer_state_bytes() / 2**20])[0]
    if rank == 0:
        Path(out).write_text(json.dumps(record))
    del runs
    distributed.shutdown(env)
    dist.barrier()
    dist.destroy_process_group()


def step_part(warmup: int, timed: int) -> dict:
    print(f"\nSTEP: default GPT, 2 gloo ranks, global 64 x 64 bytes, micro 16, accum 2, fp32; {warmup} untimed, then "
          f"{timed} timed steps a mode, the modes taking turns step by step; median of the slowest rank's times\n",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-optim-") as tmp:
        out = os.path.join(tmp, "record.json")
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), out, warmup, timed), nprocs=WORLD,
                           start_method="spawn")
        record = json.loads(Path(out).read_text())
    print("\n| strategy | optimizer | step (ms) | vs AdamW | optimizer.step() (ms) | vs AdamW | rest of the step "
          "(ms) | optimizer state (MiB) | vs AdamW | state_mb (plan) | Muon's collectives a step (bytes) | "
          "loss at the last step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rec in record.items():
        strategy, optimizer = name.split(" / ")
        base = record[f"{strategy} / AdamW"]
        step, opt = statistics.median(rec["step"]), statistics.median(rec["optimizer"])
        base_step, base_opt = statistics.median(base["step"]), statistics.median(base["optimizer"])
        comm = rec["comm"]
        calls = sum(comm.get(f"muon_{k}", 0) for k in ("all_gathers", "gathers", "scatters"))
        nbytes = sum(comm.get(f"muon_{k}_bytes", 0) for k in ("all_gather", "gather", "scatter"))
        muon = f"{calls} ({nbytes:,})" if optimizer.startswith("Muon") else ""
        print(f"| {strategy} | {optimizer} | {step * 1e3:.1f} | {step / base_step:.2f}x | {opt * 1e3:.2f} | "
              f"{opt / base_opt:.2f}x | {(step - opt) * 1e3:.1f} | {rec['optimizer_state_mb']:.3f} | "
              f"{rec['optimizer_state_mb'] / base['optimizer_state_mb']:.2f}x | {rec['state_mb']:.3f} "
              f"({rec['plan_state_mb']:.3f}) | {muon} | {rec['loss']:.4f} |")
    return record


def ns_time(shape: tuple, dtype: torch.dtype, iters: int) -> float:
    """Median seconds of one orthogonalise call (5 Newton-Schulz steps) on a random FP32 matrix of ``shape``."""
    from dist_trainer.optim.muon import orthogonalise

    update = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    orthogonalise(update, NS_STEPS, dtype)  # untimed: the kernels' first call
    times = []
    for _ in range(iters):
        began = time.perf_counter()
        orthogonalise(update, NS_STEPS, dtype)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def ns_part(iters: int) -> dict:
    print(f"\nNEWTON-SCHULZ: orthogonalise(update, {NS_STEPS}, dtype), one process, {torch.get_num_threads()} "
          f"thread(s); median of {iters} calls after one untimed; GFLOP/s from the matmuls' 2mnk\n", flush=True)
    print("| shape | fp32 (ms) | GFLOP/s | bf16 (ms) | GFLOP/s | bf16 vs fp32 |")
    print("|---|---|---|---|---|---|")
    record, layer = {}, {"fp32": 0.0, "bf16": 0.0}
    for rows, cols in GPT2_SHAPES:
        small, large = min(rows, cols), max(rows, cols)
        # per step: the Gram matrix (s x l x s), its square (s^3), the product with x (s x s x l)
        flop = NS_STEPS * 2 * (2 * small * small * large + small ** 3)
        fp32, bf16 = ns_time((rows, cols), torch.float32, iters), ns_time((rows, cols), torch.bfloat16, iters)
        layer["fp32"] += fp32
        layer["bf16"] += bf16
        record[f"{rows}x{cols}"] = {"fp32_s": fp32, "bf16_s": bf16, "flop": flop}
        print(f"| {rows}x{cols} | {fp32 * 1e3:.1f} | {flop / fp32 / 1e9:.0f} | {bf16 * 1e3:.1f} | "
              f"{flop / bf16 / 1e9:.0f} | {bf16 / fp32:.2f}x |", flush=True)
    print(f"| a layer's four | {layer['fp32'] * 1e3:.1f} | | {layer['bf16'] * 1e3:.1f} | | "
          f"{layer['bf16'] / layer['fp32']:.2f}x |")
    print(f"\nGPT-2 small's {GPT2_LAYERS} layers, one process orthogonalising every matrix (gather mode, or ddp): "
          f"{GPT2_LAYERS * layer['fp32']:.2f} s fp32, {GPT2_LAYERS * layer['bf16']:.2f} s bf16 a step (the sums "
          f"above x {GPT2_LAYERS}); owner mode on N ranks: about 1/N of it a rank")
    return {"shapes": record, "layer_fp32_s": layer["fp32"], "layer_bf16_s": layer["bf16"],
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "step", "ns"), default="all")
    parser.add_argument("--warmup", type=int, default=3, help="step: untimed steps a mode, first")
    parser.add_argument("--timed", type=int, default=30, help="step: timed steps a mode, the modes in turn")
    parser.add_argument("--iters", type=int, default=5, help="ns: timed calls a shape and dtype")
    parser.add_argument("--json", help="also write every number to this file")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(machine_description(), flush=True)
    out = {}
    if args.part in ("all", "step"):
        out["step"] = step_part(args.warmup, args.timed)
    if args.part in ("all", "ns"):
        out["ns"] = ns_part(args.iters)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
