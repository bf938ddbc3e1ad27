"""Tensor parallelism on 4 CPU ranks: step time against ddp and fsdp, state and activations per rank.

    python bench/tp.py                    # both parts, about 6 minutes on 2 cores
    python bench/tp.py --part speed       # median step time of each mode, side by side, relative to ddp
    python bench/tp.py --part memory      # state_mb, and the activations one micro-batch saves for backward

Every mode runs the default GPT (4 blocks x 128 wide, 4 heads, AdamW, fp32) on the same 4
ranks with the same global batch of 64 sequences of 64 bytes and micro-batches of 16:

* ddp and fsdp: 4 data-parallel ranks, accum 1;
* tp 2 x ddp 2, tp 2 x fsdp 2 (sequence parallelism on and off): 2 data-parallel ranks, accum 2;
* tp 4: one data-parallel rank, accum 4.

speed: ``torchrun -m dist_trainer``, the modes alternated over rounds, the median
``step_time_s`` after the warm-up steps. 4 ranks on 2 cores are oversubscribed and gloo
emulates reduce-scatters with all-reduces, so this measures the CPU cost of the machinery
(DTensor's dispatch, the counted collectives), not what a GPU's links would give.

memory: ``state_mb`` from metrics.jsonl, and the bytes of the tensors one micro-batch's
forward saves for backward on rank 0 (``torch.autograd.graph.saved_tensors_hooks``, each
storage once), measured in 4 spawned ranks built as a run builds them.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, rounds_parser, run_dist_trainer  # noqa: E402

WORLD = 4
BASE = ["batch.micro_batch_size=16", "batch.global_batch_size=64"]
MODES = {
    "ddp": [],
    "fsdp": ["dist.strategy=fsdp"],
    "tp 2 x ddp 2": ["dist.tp.size=2"],
    "tp 2 x fsdp 2": ["dist.tp.size=2", "dist.strategy=fsdp"],
    "tp 2 x fsdp 2, no sp": ["dist.tp.size=2", "dist.strategy=fsdp", "dist.tp.sequence_parallel=false"],
    "tp 4": ["dist.tp.size=4"],
}


def speed_part(rounds: int, warmup: int, timed: int) -> dict:
    print(f"\nSTEP TIME: {WORLD} ranks, global 64 x 64 bytes, micro 16; {warmup} warm-up + {timed} timed steps, "
          f"modes alternated over {rounds} rounds; median step_time_s\n", flush=True)
    results = {name: [] for name in MODES}
    for rnd in range(1, rounds + 1):
        for name, keys in MODES.items():
            recs = run_dist_trainer(BASE + keys, warmup + timed, WORLD)
            times = [r["step_time_s"] for r in recs[warmup:]]
            results[name].append({"times": times, "loss": recs[-1]["loss"], "state_mb": recs[-1]["state_mb"]})
            print(f"round {rnd} {name:22s} median {statistics.median(times) * 1000:7.1f} ms/step "
                  f"(loss at step {warmup + timed}: {recs[-1]['loss']:.6f})", flush=True)
    ddp = statistics.median(t for r in results["ddp"] for t in r["times"])
    print("\n| mode | median step (ms) | vs ddp | state_mb | loss at the last step |")
    print("|---|---|---|---|---|")
    for name in MODES:
        med = statistics.median(t for r in results[name] for t in r["times"])
        last = results[name][-1]
        print(f"| {name} | {med * 1000:.1f} | {med / ddp:.2f}x | {last['state_mb']:.2f} | {last['loss']:.6f} |")
    return results


def _saved_bytes(rank: int, world: int, overrides: list, out: str) -> None:
    """Rank ``rank``: build the run's parts, run one micro-batch's forward, sum what autograd saved."""
    import torch

    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import dist_trainer.cli  # noqa: F401  (registers the schema)
    from dist_trainer import distributed
    from dist_trainer.validation import validate
    from dist_trainer.data import epoch_batches
    from dist_trainer.run import build

    env = distributed.init("cpu")
    with initialize_config_module("dist_trainer.conf", version_base=None):
        cfg = OmegaConf.to_object(compose("config", BASE + overrides))
    parts = build(cfg, validate(cfg, world), env)
    trainer = parts.trainer
    window, batches = next(iter(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)))
    seen, total = set(), [0]

    def pack(t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen and local.device.type != "meta":
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    with trainer.strategy.micro_batch(last=True):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = trainer.model(batches[0])["loss_sum"]
        (loss.to_local() if hasattr(loss, "to_local") else loss).backward()  # every rank joins the collectives
    if rank == 0:
        from dist_trainer.plan import plan_numbers

        predicted = plan_numbers(cfg, validate(cfg, world), trainer.module)["norm_activation_mb"]
        Path(out).write_text(json.dumps({"saved_bytes": total[0], "norm_activation_mb": predicted}))
    del trainer, parts
    distributed.shutdown(env)


def memory_part() -> dict:
    import torch.multiprocessing as mp

    print(f"\nMEMORY: per rank, {WORLD} ranks; state_mb after an optimizer step (metrics.jsonl), and the "
          "activations one micro-batch of 16 x 64 tokens saves for backward (rank 0)\n", flush=True)
    print("| mode | state_mb | activations saved (MiB) | of which the norms', predicted (norm_activation_mb) |")
    print("|---|---|---|---|")
    rows = {}
    for name, keys in MODES.items():
        state = run_dist_trainer(BASE + keys, 2, WORLD)[-1]["state_mb"]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "saved.json")
            mp.start_processes(_spawned, args=(WORLD, tmp, keys, out), nprocs=WORLD, start_method="spawn")
            result = json.loads(Path(out).read_text())
        saved, norms = result["saved_bytes"], result["norm_activation_mb"]
        rows[name] = {"state_mb": state, "saved_mib": saved / 2**20, "norm_activation_mb": norms}
        print(f"| {name} | {state:.2f} | {saved / 2**20:.2f} | {'-' if norms is None else f'{norms:.2f}'} |",
              flush=True)
    on, off = rows["tp 2 x fsdp 2"], rows["tp 2 x fsdp 2, no sp"]
    print(f"\nsequence parallelism cuts {off['saved_mib'] - on['saved_mib']:.2f} MiB of saved activations per "
          f"micro-batch on a rank (measured); predicted {off['norm_activation_mb'] - on['norm_activation_mb']:.2f} MiB "
          "(the norms' inputs and statistics, halved)")
    return rows


def _spawned(rank: int, world: int, tmp: str, keys: list, out: str) -> None:
    import os

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(29600 + len(tmp) % 50), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    import torch

    torch.set_num_threads(1)
    _saved_bytes(rank, world, keys, out)


def main() -> None:
    args = rounds_parser(__doc__, ("speed", "memory"), timed=8).parse_args()
    print(machine_description(), flush=True)
    out = {}
    if args.part in ("all", "memory"):
        out["memory"] = memory_part()
    if args.part in ("all", "speed"):
        out["speed"] = speed_part(args.rounds, args.warmup, args.timed)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
