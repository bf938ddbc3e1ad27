"""What a checkpoint costs training: blocking saves against background ones (trainer.ckpt_async), on 2 ranks.

    python bench/ckpt.py                 # about 6 minutes on 2 cores
    python bench/ckpt.py --rounds 3      # more rounds, alternated

Two models, each saved by ddp (rank 0 writes the FP32 model and AdamW's state) and by fsdp (each rank its
shards), with ``trainer.ckpt_async`` false and true, every mode a real ``torchrun -m dist_trainer`` run:

* the default GPT (4 blocks x 128 wide; 12.7 MiB of state a ddp rank): 12 steps, a checkpoint every 3;
* a GPT-2-small-shaped one (12 blocks x 768 wide, 12 heads, a 256-byte vocabulary: 85 M parameters,
  0.95 GiB of FP32 model and AdamW state): 9 steps, a checkpoint every 3, micro 1 x accum 1 (a step of a
  few seconds on CPU), so that a save is a large part of a step.

For each mode, over the checkpoints written before the last (the last one always blocks):

* ``ckpt_blocking_s``: what the step waited for its checkpoint (blocking: the whole write, hash and fsync;
  background: the copy into host memory, plus any wait for the save before it);
* ``ckpt_wait_s``: the part of that stall spent waiting for the previous save (one save in flight);
* ``ckpt_write_s``: the background write's own time, from staging to seal;
* ``ckpt_staging_mb``: the host memory that copy takes on rank 0 (plan mode predicts it);
* the median step time of steps without a checkpoint, and of the steps during which a write ran: on two
  cores the writer thread competes with the two ranks' compute, which a GPU node's host CPUs would not.

The ratio printed is the stall per checkpoint, blocking over background, measured side by side in one run.
With ``--s3`` (moto installed: the test extras), the default GPT's modes run again with
``trainer.ckpt_dir=s3://...`` against moto's S3 server on the loopback (a Python process keeping objects in
memory: its speed is not S3's, but every byte goes through s3fs and HTTP as it would).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, rounds_parser, run_dist_trainer_with_plan  # noqa: E402

GPT2_SMALL = ["model.n_layer=12", "model.n_embd=768", "model.n_head=12", "batch.micro_batch_size=1",
              "batch.global_batch_size=2"]
# (overrides, steps, checkpoint every): the GPT-2-small shape's write takes longer than a step here, so its
# checkpoints are 3 steps apart, which a background write fits in (a closer one would wait for it: ckpt_wait_s).
MODELS = {
    "default GPT": ([], 12, 3),
    "GPT-2-small shape": (GPT2_SMALL, 9, 3),
}
S3_MODELS = {"default GPT, S3": ([], 12, 3)}
STRATEGIES = {"ddp": [], "fsdp": ["dist.strategy=fsdp"]}


def _median(values):
    return statistics.median(values) if values else float("nan")


def measure(overrides, steps: int, every: int, background: bool) -> dict:
    recs, plan = run_dist_trainer_with_plan(
        overrides + [f"trainer.ckpt_every={every}", f"trainer.ckpt_async={str(background).lower()}",
                     "trainer.keep_checkpoints=2"], steps)
    saves = [r for r in recs if "ckpt_blocking_s" in r and r["step"] < steps]
    writing = set()
    for r in saves if background else []:  # the steps after a background save, until its write is logged as sealed
        later = [q["step"] for q in recs if q["step"] > r["step"] and "ckpt_write_s" in q]
        writing.update(range(r["step"] + 1, (later[0] if later else steps) + 1))
    plain = [r["step_time_s"] for r in recs if r["step"] > 1 and "ckpt_blocking_s" not in r
             and r["step"] not in writing]
    return {"blocking_s": _median([r["ckpt_blocking_s"] for r in saves]),
            "wait_s": _median([r.get("ckpt_wait_s", 0.0) for r in saves]),
            "write_s": _median([r["ckpt_write_s"] for r in recs if "ckpt_write_s" in r]),
            "staging_mb": _median([r["ckpt_staging_mb"] for r in saves if "ckpt_staging_mb" in r]),
            "planned_staging_mb": plan["ckpt_staging_mb"],
            "step_s": _median(plain),
            "step_while_writing_s": _median([r["step_time_s"] for r in recs if r["step"] in writing
                                            and "ckpt_blocking_s" not in r]),
            "loss": recs[-1]["loss"]}


def moto_server() -> subprocess.Popen:
    """moto's S3 server on the loopback, a bucket in it, and the environment every run inherits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    import s3fs

    for _ in range(300):
        try:
            s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
            return server
        except Exception:  # noqa: BLE001 - still starting
            time.sleep(0.2)
    raise RuntimeError("moto's server did not start")


def main() -> None:
    parser = rounds_parser(__doc__)
    parser.add_argument("--s3", action="store_true", help="also through moto's S3 server (the default GPT)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args()
    models = {name: MODELS[name] for name in args.models}
    server = None
    if args.s3:
        server = moto_server()
        models.update({name: (keys + ["trainer.ckpt_dir=s3://bench/{run}"], steps, every)
                       for name, (keys, steps, every) in S3_MODELS.items()})
    print(machine_description(), flush=True)
    print(f"\n2 ranks; modes alternated over {args.rounds} rounds; medians over the checkpoints before the last\n",
          flush=True)
    results = {}
    for rnd in range(1, args.rounds + 1):
        for model, (overrides, steps, every) in models.items():
            for strategy, keys in STRATEGIES.items():
                for background in (False, True):
                    name = (model, strategy, background)
                    fresh = [o.replace("{run}", uuid.uuid4().hex) for o in overrides]  # a prefix per run
                    row = measure(fresh + keys, steps, every, background)
                    results.setdefault(name, []).append(row)
                    print(f"round {rnd} {model} {strategy} {'background' if background else 'blocking'}: "
                          f"{json.dumps({k: round(v, 4) for k, v in row.items()})}", flush=True)
    print("\n| model | strategy | blocking save: stall (s) | background: stall (s), of which waiting | stall ratio | "
          "background write (s) | host copy, rank 0 (MiB; planned) | step (s) | step while writing (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = {}
    for model in models:
        for strategy in STRATEGIES:
            sync, bg = ({key: _median([r[key] for r in rows]) for key in rows[0]}
                        for rows in (results[(model, strategy, False)], results[(model, strategy, True)]))
            table[f"{model}, {strategy}"] = {"blocking": sync, "background": bg}
            print(f"| {model} | {strategy} | {sync['blocking_s']:.3f} | {bg['blocking_s']:.3f}, {bg['wait_s']:.3f} | "
                  f"{sync['blocking_s'] / bg['blocking_s']:.1f}x | {bg['write_s']:.3f} | "
                  f"{bg['staging_mb']:.1f}; {bg['planned_staging_mb']:.1f} | {sync['step_s']:.3f} | "
                  f"{bg['step_while_writing_s']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    if server is not None:
        server.terminate()


if __name__ == "__main__":
    main()
