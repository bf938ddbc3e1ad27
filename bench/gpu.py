"""Tokens/s, MFU and peak memory: precision modes, torch.compile off and on, ddp and fsdp, activation
checkpointing, one GPU.

    python bench/gpu.py            # one CUDA GPU (made for an H200: under 8 minutes)
    python bench/gpu.py --smoke    # CPU, a tiny GPT, 2 steps per configuration: checks the script itself
    python bench/gpu.py --modes bf16-master --extra none --moe none   # bf16-master, float8 and Muon rows only
    python bench/gpu.py --smoke --compile off --fp8 all --optim all   # CPU: the float8 (emulated) and Muon rows too

What runs is dist_trainer's own Trainer, built by ``dist_trainer.run.build`` from
a ``Config`` in a process group of one (``dist_trainer.distributed.init``, so
DDP or FSDP over one rank, as ``python -m dist_trainer`` runs it), fed by
``dist_trainer.data.epoch_batches`` from a token file (``data=tokens``); each
step is ``Trainer.train_step``. Nothing is downloaded: the token file is
written first, random ids of GPT-2's vocabulary (the step's cost does not
depend on which tokens they are).

The model is GPT-2 small: dist_trainer.models.GPT(n_layer=12, n_head=12,
n_embd=768, block_size=1024, vocab_size=50257), 124 M parameters;
micro-batch 16 sequences x 1024 tokens, accum 1. "compile on" is the
framework's ``trainer.compile=true`` (block by block, batch dimension dynamic).

Rows: ddp with bf16-mixed, bf16-master and fp16-master, eager and compiled;
then (``--extra=none`` leaves them out) fsdp bf16-master eager and compiled
with ``dist.fsdp.prefetch`` 1 (the default) and 0 (on one GPU: the cost of the
wrapping of a world of one; a shard group of one rank gathers nothing, so the
prefetch rows can only show that it costs nothing there, the overlap it buys
needs several GPUs) and ddp bf16-master with activation checkpointing, eager
and compiled (memory saved, time spent); then (``--moe=none`` leaves them out) the GPT with 8 experts a
layer, top 2, under the global and the sequence aux scope (the cost of the global term's counting pass).

Float8 and Muon rows (on a GPU they run right after the ddp grid, before the fsdp and checkpointing rows, so that
the 400 s budget reaches them; ``--smoke`` leaves them out unless ``--fp8=all`` or ``--optim=all`` asks, so the
suite's smoke test keeps its rows): ``precision=fp8-rowwise`` and ``fp8-tensorwise`` (torchao's float8 linears,
``precision.fp8.compute=bf16``: 72 of GPT-2 small's 73 linears, the head kept in bf16; real float8 matmuls on
compute capability 8.9 and above, emulated below it and on a CPU, as ``precision.fp8.emulate: auto`` decides and
the row's ``fp8_emulated`` says), ddp, eager and compiled (torchao means float8 training to run compiled: eager,
its casts and scales are kernels of their own), against the grid's bf16-master row of the same compile setting; and
``optim.name=muon`` with ``optim.muon.dist=gather`` (optim.muon's defaults, conf/optim/muon.yaml's: lr 0.02,
momentum 0.95, Newton-Schulz 5 steps in fp32, on the hidden matrices; AdamW on the rest, with the other rows' lr;
on one GPU a world of one gathers nothing, so these rows measure Newton-Schulz's own cost on the GPU), bf16-master,
eager, under ddp and fsdp, against AdamW's bf16-master row of the same strategy (eager only: compile changes the
model's part of the step, which the grid's compiled rows already show, and never the optimizer's). The column "vs
base" is the row's step time over its base row's, from the same run (a base that ``--modes`` or ``--extra=none``
leaves out runs anyway, first); MFU counts the model's FLOPs only (Muon's Newton-Schulz iterations are not in it,
so they show as a lower MFU) against the half-precision dense peak for every half-precision row, float8's included
(float8's own dense peak on an H100 or H200 is twice that; the head, attention's products and the rest stay bf16),
so the float8 and bf16 rows compare directly. No GPU number for these rows has been measured yet.

Per configuration: ``--warmup`` steps (compilation happens there), then
``--steps`` timed steps; tokens/s = tokens / (wall time of the timed steps,
synchronised at both ends); MFU = model.flops_per_item() x tokens/s /
dist_trainer.metrics.peak_flops(device, half precision) (CUDA dense peaks;
None on CPU); peak memory = dist_trainer.metrics.peak_mem_mb (CUDA: peak
allocated, reset before each configuration; CPU: the process's peak resident
set, which only grows, so later CPU rows are upper bounds).

A configuration that raises is reported with its error (the traceback on
stderr) and the next one runs; the exit status is then 1. ``--json`` is
rewritten after every configuration, so a run stopped from outside (a time
limit) still leaves the rows it finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("bf16-mixed", "bf16-master", "fp16-master")
# (precision, dist.strategy, dist.activation_checkpointing, dist.fsdp.prefetch) after the grid, each eager
# and compiled.
EXTRA = (("bf16-master", "fsdp", False, 1), ("bf16-master", "fsdp", False, 0), ("bf16-master", "ddp", True, 1))
FULL = {"model": dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0),
        "micro": 16, "warmup": 3, "steps": 15,
        "moe": {"num_experts": 8, "top_k": 2, "hidden": 1536}}
SMOKE = {"model": dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=0.0),
         "micro": 4, "warmup": 1, "steps": 1, "moe": {"num_experts": 4, "top_k": 2, "hidden": 128}}
# Mixture-of-experts rows (--moe=none leaves them out): the same GPT with every MLP a layer of 8 SwiGLU experts
# (2 a token, hidden 1536: a token goes through 1.5 times the dense 4 x 768 MLP's weights),
# bf16-master, eager, micro-batches of half the size accumulated twice, so the global aux term's counting pass
# (one forward more per micro-batch) runs: its cost is the global row against the sequence row, which needs none.
MOE_SCOPES = ("global", "sequence")
FP8_MODES = ("fp8-rowwise", "fp8-tensorwise")  # each against the grid's bf16-master row, eager and compiled
# Muon rows (--optim=none leaves them out): (optim.name, dist.strategy, dist.fsdp.prefetch), bf16-master, eager
OPTIM_ROWS = (("muon", "ddp", 1), ("muon", "fsdp", 1))


def write_token_file(path: Path, spec: dict, samples: int) -> Path:
    """Random ids of the model's vocabulary, ``samples`` windows of block_size + 1 and some to spare."""
    import numpy as np

    tokens = (samples + 8) * (spec["model"]["block_size"] + 1)
    ids = np.random.default_rng(0).integers(0, spec["model"]["vocab_size"], tokens, dtype=np.uint16)
    ids.tofile(path)
    return path


def run_config(env, spec: dict, tokens: Path, precision: str, compile_model: bool, warmup: int, steps: int,
               strategy: str = "ddp", checkpointing: bool = False, prefetch: int = 1, moe_scope: str = "",
               optim: str = "adamw") -> dict:
    import torch

    from dist_trainer.config import (BatchConfig, Config, DistConfig, FSDPConfig, MuonConfig, OptimConfig,
                                     PrecisionConfig, TrainerConfig)
    from dist_trainer.validation import validate
    from dist_trainer.data import epoch_batches
    from dist_trainer.metrics import peak_flops, peak_mem_mb
    from dist_trainer.run import build, to_device

    cuda = env.device.type == "cuda"
    model_cfg = {"_target_": "dist_trainer.models.GPT", **spec["model"]}
    micro, accum = spec["micro"], 1
    if moe_scope:  # half the micro-batch, twice: the step has two micro-batches
        model_cfg["moe"] = {**spec["moe"], "aux_loss": {"coef": 0.01, "scope": moe_scope}}
        micro, accum = spec["micro"] // 2, 2
    cfg = Config(model=model_cfg,
                 data={"_target_": "dist_trainer.data.tokens.token_file", "path": str(tokens), "dtype": "uint16",
                       "block_size": spec["model"]["block_size"], "vocab_size": spec["model"]["vocab_size"]},
                 batch=BatchConfig(micro_batch_size=micro, accum_steps=accum),
                 precision=PrecisionConfig(name=precision),
                 # Muon in gather mode (every rank gathers each cut matrix whole) with conf/optim/muon.yaml's keys
                 optim=OptimConfig(name=optim, lr=6e-4, grad_clip=1.0, muon=MuonConfig(dist="gather")),
                 trainer=TrainerConfig(max_steps=warmup + steps, device=env.device.type, compile=compile_model),
                 dist=DistConfig(strategy=strategy, activation_checkpointing=checkpointing,
                                 fsdp=FSDPConfig(prefetch=prefetch)))
    plan = validate(cfg, env.world_size)
    if cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    parts = build(cfg, plan, env)
    trainer = parts.trainer
    model = trainer.module
    pin = cuda
    train_set, step_plan = parts.train_set, parts.step_plan

    def batches():
        epoch = 0
        while True:
            yield from epoch_batches(train_set, step_plan, epoch, 0, 0, pin)
            epoch += 1

    def sync():
        if cuda:
            torch.cuda.synchronize(env.device)

    source = batches()
    t_build = time.perf_counter()
    items, outcome = 0, None
    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            sync()
            start = time.perf_counter()
            warm_s = start - t_build
        window, micro_batches = next(source)
        outcome = trainer.train_step([to_device(b, env.device) for b in micro_batches], window, step)
        if step > warmup:
            items += outcome.items
    sync()
    elapsed = time.perf_counter() - start
    tokens_per_s = items / elapsed
    peak = peak_flops(env.device, trainer.precision.autocast_dtype is not None)
    mfu = model.flops_per_item() * tokens_per_s / peak if peak else None
    float8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]  # torchao's, where converted
    result = {"precision": precision, "compile": compile_model, "strategy": strategy, "ac": checkpointing,
              "moe_scope": moe_scope or None, "optim": optim, "fp8_linears": len(float8),
              "fp8_emulated": any(m.config.emulate for m in float8) if float8 else None,
              "prefetch": prefetch if strategy == "fsdp" else None,
              "tokens_per_s": tokens_per_s, "mfu": mfu,
              "peak_mem_mb": peak_mem_mb(env.device), "step_ms": 1000 * elapsed / steps, "warmup_s": warm_s,
              "loss": outcome.loss, "skipped": outcome.skipped, "state_mb": outcome.state_mb,
              "params": sum(p.numel() for p in model.parameters())}
    return result


def release(device, compile_model: bool) -> None:
    """Frees what a configuration held, finished or failed, before the next one is built."""
    import torch

    gc.collect()
    if compile_model:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_line(exc: Exception) -> str:
    """The exception's type and the first line of its message, the second too where the first ends in ':'
    (``backend='inductor' raised:``); compiler errors run to pages."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
    return f"{type(exc).__name__}: {head[:300]}"


def versus_base(row: dict, results: list) -> str:
    """A float8 row's step time over bf16-master's (ddp, same compile), a Muon row's over AdamW's (bf16-master,
    eager, same strategy and prefetch); empty for the other rows or where the base did not run."""
    if row["precision"] in FP8_MODES:
        want = ("bf16-master", "adamw", row["compile"], "ddp", False, None, None)
    elif row["optim"] != "adamw":
        want = ("bf16-master", "adamw", False, row["strategy"], False, None, row["prefetch"])
    else:
        return ""
    base = next((r for r in results if (r["precision"], r["optim"], r["compile"], r["strategy"], r["ac"],
                                        r.get("moe_scope"), r["prefetch"]) == want and "step_ms" in r), None)
    return f"{row['step_ms'] / base['step_ms']:.2f}x" if base else ""


def write_json(path: str, device_name: str, spec: dict, results: list) -> None:
    Path(path).write_text(json.dumps({"device": device_name, "spec": spec, "results": results}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 steps per mode")
    parser.add_argument("--modes", default=",".join(MODES), help="precision modes of the ddp grid")
    parser.add_argument("--compile", choices=("both", "off", "on"), default="both")
    parser.add_argument("--extra", choices=("all", "none"), default="all",
                        help="the fsdp and activation-checkpointing rows after the grid")
    parser.add_argument("--warmup", type=int, help="steps before timing (default 3; smoke 1)")
    parser.add_argument("--steps", type=int, help="timed steps (default 15; smoke 1)")
    parser.add_argument("--moe", choices=("all", "none"), default="all",
                        help="the mixture-of-experts rows after the others (global and sequence aux scopes)")
    parser.add_argument("--fp8", choices=("all", "none"),
                        help="the float8 rows after the ddp grid (default: all on a GPU, none with --smoke)")
    parser.add_argument("--optim", choices=("all", "none"),
                        help="the Muon (gather) rows after the float8 ones (default: all on a GPU, none with --smoke)")
    parser.add_argument("--budget-s", type=float, default=400.0,
                        help="stop starting new configurations after this many seconds (the rest are reported as skipped)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    t0 = time.perf_counter()

    import torch

    from dist_trainer import distributed

    spec = dict(SMOKE if args.smoke else FULL)
    warmup = args.warmup if args.warmup is not None else spec["warmup"]
    steps = args.steps if args.steps is not None else spec["steps"]
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke on CPU")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # a process group of one, whatever launched us
    env = distributed.init("cpu" if args.smoke else "cuda")
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU"
    m = spec["model"]
    print(f"device {device_name}, torch {torch.__version__}; GPT n_layer={m['n_layer']} n_head={m['n_head']} "
          f"n_embd={m['n_embd']} block={m['block_size']} vocab={m['vocab_size']}; micro {spec['micro']} x "
          f"accum 1; {warmup} warm-up + {steps} timed steps per configuration", flush=True)
    compiles = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    # the float8 and Muon rows right after the grid, whose bf16-master rows they are measured against
    fp8, optim = (flag or ("none" if args.smoke else "all") for flag in (args.fp8, args.optim))
    configs = [(mode, c, "ddp", False, 1, "", "adamw") for mode in args.modes.split(",") for c in compiles]
    extra = ([(mode, c, strategy, ac, prefetch, "", "adamw") for mode, strategy, ac, prefetch in EXTRA
              for c in compiles] if args.extra == "all" else [])
    rows = ([(mode, c, "ddp", False, 1, "", "adamw") for mode in FP8_MODES for c in compiles] if fp8 == "all" else [])
    rows += ([("bf16-master", False, strategy, False, prefetch, "", name) for name, strategy, prefetch in OPTIM_ROWS]
             if optim == "all" else [])
    # each float8 or Muon row's base (bf16-master with AdamW, same compile, strategy and prefetch), run first
    # where the grid or the extra rows do not already hold it (--modes without bf16-master, --extra none)
    bases = [("bf16-master", c, strategy, False, prefetch, "", "adamw") for _, c, strategy, _, prefetch, _, _ in rows]
    configs += [b for b in dict.fromkeys(bases) if b not in configs + extra]
    configs += rows + extra
    configs += ([("bf16-master", False, "ddp", False, 1, scope, "adamw") for scope in MOE_SCOPES]
                if args.moe == "all" else [])
    scratch = tempfile.TemporaryDirectory(prefix="gpu-bench-")
    tokens = write_token_file(Path(scratch.name) / "train.bin", spec, (warmup + steps) * spec["micro"])
    results = []
    for mode, comp, strategy, ac, prefetch, scope, optim_name in configs:
        name = (f"{mode:14s} compile={'on ' if comp else 'off'} {strategy:4s} ac={'on ' if ac else 'off'}"
                + (f" prefetch={prefetch}" if strategy == "fsdp" else "           ")
                + (f" moe aux={scope}" if scope else "") + (f" optim={optim_name}" if optim_name != "adamw" else ""))
        row = {"precision": mode, "compile": comp, "strategy": strategy, "ac": ac, "moe_scope": scope or None,
               "optim": optim_name, "prefetch": prefetch if strategy == "fsdp" else None}
        if time.perf_counter() - t0 > args.budget_s:
            results.append({**row, "skipped_for_time": True})
            print(f"{name} skipped: past --budget-s", flush=True)
            continue
        try:
            r = run_config(env, spec, tokens, mode, comp, warmup, steps, strategy, ac, prefetch, scope, optim_name)
        except Exception as exc:  # noqa: BLE001 - one configuration's failure must not cost the others' rows
            traceback.print_exc()
            r = {**row, "error": first_line(exc)}
        release(env.device, comp)  # after the except block: its traceback no longer holds the model
        results.append(r)
        if args.json:
            write_json(args.json, device_name, spec, results)
        if "error" in r:
            print(f"{name} FAILED: {r['error']}", flush=True)
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"{name} {r['tokens_per_s']:12,.0f} tokens/s | MFU {mfu:>6s} | "
              f"peak {r['peak_mem_mb']:9,.0f} MiB | {r['step_ms']:8.1f} ms/step | warm-up {r['warmup_s']:5.1f} s | "
              f"loss {r['loss']:.4f}{' SKIPPED STEP' if r['skipped'] else ''}", flush=True)
    print("\n| precision | optimizer | torch.compile | strategy | activation ckpt | prefetch | MoE aux scope | "
          "tokens/s | MFU | peak memory (MiB) | state_mb | step (ms) | vs base |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        head = (f"| {r['precision']} | {r['optim']} | {'on' if r['compile'] else 'off'} | {r['strategy']} | "
                f"{'on' if r['ac'] else 'off'} | {'' if r['prefetch'] is None else r['prefetch']} | "
                f"{r.get('moe_scope') or ''} |")
        if r.get("skipped_for_time") or "error" in r:
            print(f"{head} {'failed: ' + r['error'] if 'error' in r else 'skipped (time budget)'} | | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"{head} {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_mem_mb']:,.0f} | {r['state_mb']:,.1f} | "
              f"{r['step_ms']:.1f} | {versus_base(r, results)} |")
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        write_json(args.json, device_name, spec, results)
    scratch.cleanup()
    distributed.shutdown(env)
    failed = [r for r in results if "error" in r]
    if failed:
        sys.exit(f"{len(failed)} of {len(results)} configurations failed (tracebacks above)")


if __name__ == "__main__":
    main()
