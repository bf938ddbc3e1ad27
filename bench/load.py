"""Host memory and time at both ends of a run: loading a pretrained model and exporting it, on 2 ranks.

    python bench/load.py                       # a 216 MiB and a 1 GiB qwen2, about 10 minutes on 2 cores
    python bench/load.py --sizes 216           # the small one only

Each model is a qwen2 saved by transformers (head tied to the embedding, safetensors files of at most
500 MB with an index). Every mode is a real ``torchrun -m dist_trainer`` run of one optimizer step (micro
batch 1 x 32 tokens) that ends with ``final_model.pt`` and ``hf_model/``:

* ddp: every rank builds the whole model (``from_pretrained``), as every mesh did before;
* fsdp and tp 2, ``dist.meta_init=false``: built whole on every rank, then sharded (the behaviour before);
* fsdp and tp 2 (``dist.meta_init=true``, the default): built on the meta device, each rank reading its slices.

Per mode: each rank's host memory added by the load and by the export (``host_memory.json``: the kernel's
peak resident memory over the phase, minus what the process held before it), plan mode's prediction, and the
time from the process's first log line to the first step's record (imports, data, model, one step). The
ratios put the sharded load beside the whole build of the same mesh, measured in one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

SHAPES = {  # MiB of FP32 weights -> the qwen2 configuration (tied head)
    216: {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 7, "num_attention_heads": 12,
          "num_key_value_heads": 4, "vocab_size": 16384},
    1024: {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 9, "num_attention_heads": 12,
           "num_key_value_heads": 4, "vocab_size": 32768},
}
MODES = {
    "ddp": [],
    "fsdp, built whole": ["dist.strategy=fsdp", "dist.meta_init=false"],
    "fsdp": ["dist.strategy=fsdp"],
    "tp 2, built whole": ["dist.tp.size=2", "dist.meta_init=false"],
    "tp 2": ["dist.tp.size=2"],
}


def save_model(root: Path, mib: int, shapes: dict = SHAPES) -> Path:
    import torch
    import transformers

    out = root / f"qwen2-{mib}"
    if not out.exists():
        config = transformers.AutoConfig.for_model("qwen2", **shapes[mib], tie_word_embeddings=True,
                                                   max_position_embeddings=128)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
            out, max_shard_size="500MB")
    return out


def _stamp(line: str) -> datetime.datetime:
    return datetime.datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")


def run_mode(model: Path, text: Path, run_dir: Path, overrides: list) -> dict:
    args = ["model=hf_causal_lm", f"model.pretrained={model}", "data=hf_text", f"data.files=[{text}]",
            "data.block_size=32", f"data.cache_dir={run_dir.parent / 'cache'}", "batch.micro_batch_size=1",
            "batch.global_batch_size=2", "trainer.max_steps=1", "trainer.ckpt_every=0", "trainer.device=cpu",
            f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "dist_trainer", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    lines = [line for line in (run_dir / "rank0.log").read_text().splitlines() if line.startswith("[20")]
    first_step = next(line for line in lines if "step 1/1" in line)
    return {"memory": json.loads((run_dir / "host_memory.json").read_text()),
            "plan": json.loads((run_dir / "plan.json").read_text()),
            "first_step_s": (_stamp(first_step) - _stamp(lines[0])).total_seconds()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    print(machine_description())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        text = root / "text.txt"
        text.write_text("The quick brown fox jumps over the lazy dog.\n\n" * 200)
        for mib in args.sizes:
            model = save_model(root, mib)
            size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**20
            results = {name: run_mode(model, text, root / f"{mib}-{i}", overrides)
                       for i, (name, overrides) in enumerate(MODES.items())}
            for name, r in results.items():
                load, export = r["memory"]["load_host_peak_mb"], r["memory"].get("export_host_peak_mb")
                whole = results.get(f"{name}, built whole")
                rows.append({"model_mib": round(size), "mode": name, "load_mb": max(load),
                             "load_planned_mb": r["plan"].get("load_host_peak_mb"),
                             "load_ratio_whole_over_sharded": (max(whole["memory"]["load_host_peak_mb"]) / max(load)
                                                               if whole else None),
                             "export_mb": max(export) if export else None,
                             "export_planned_mb": r["plan"].get("export_host_peak_mb"),
                             "first_step_s": r["first_step_s"]})
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n| model (MiB) | mode | load, most of a rank (MiB; planned) | whole / sharded | export (MiB; planned) "
          "| to the first step (s) |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['load_ratio_whole_over_sharded']:.2f}x" if r["load_ratio_whole_over_sharded"] else ""
        export = (f"{r['export_mb']:.0f}; {r['export_planned_mb']:.0f}" if r["export_mb"] is not None and
                  r["export_planned_mb"] is not None else "")
        print(f"| {r['model_mib']} | {r['mode']} | {r['load_mb']:.0f}; {r['load_planned_mb']:.0f} | {ratio} | "
              f"{export} | {r['first_step_s']:.1f} |")


if __name__ == "__main__":
    main()
