"""Host memory at both ends of a run and through it: a pretrained model of 200 MB or more, saved by
transformers, trained on 2 real torchrun ranks under fsdp and under tp 2, to its final_model.pt and hf_model/.
Each rank's measured peak (host_memory.json: what loading, then exporting, added to the process's resident
memory) stays below 0.6x the model's FP32 size, where building it whole on every rank (ddp, as every mesh did
before) costs more than 1x. The load equals plan.json's prediction within 10 %; the export stays within
plan.json's bound. Over the whole run (``run_host_peak_mb``), what the model adds to a rank under fsdp is its
shard and a unit's buffers, not a heap that keeps what the steps freed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_module

# A qwen2 with its head tied to the embedding (cut by vocabulary rows under tp): 8 layers of width 768, its
# largest tensor (the embedding, 24 MiB) a tenth of it, as in the models this is for (Llama 3 8B: 6 %).
QWEN2 = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
         "num_key_value_heads": 4, "vocab_size": 8192, "tie_word_embeddings": True,
         "max_position_embeddings": 128}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    import transformers

    root = tmp_path_factory.mktemp("big")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("qwen2", **QWEN2),
                                                          dtype=torch.float32)
    model.save_pretrained(root / "qwen2", max_shard_size="100MB")  # three files and an index
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog.\n\n" * 200)
    # The text tokenized once, by plan mode (it builds the dataset): a run that tokenizes imports datasets'
    # libraries on rank 0 (about 90 MiB), which would stand in the comparisons between runs below
    proc = run_module([*_args(root, root / "plan", "qwen2", 1), "plan.only=true", "plan.world_size=2"], root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def _model_mb(saved: Path, name: str = "qwen2") -> float:
    return sum(f.stat().st_size for f in (saved / name).glob("*.safetensors")) / 2**20


def _args(saved: Path, run_dir: Path, model: str, steps: int) -> list:
    return ["model=hf_causal_lm", f"model.pretrained={saved / model}", "data=hf_text",
            f"data.files=[{saved / 'text.txt'}]", "data.block_size=32", f"data.cache_dir={saved / 'cache'}",
            "batch.micro_batch_size=1", "batch.global_batch_size=2", f"trainer.max_steps={steps}",
            "trainer.ckpt_every=0", "trainer.device=cpu", f"hydra.run.dir={run_dir}"]


def _run(saved: Path, run_dir: Path, *mesh: str, model: str = "qwen2", steps: int = 1) -> dict:
    proc = run_module([*_args(saved, run_dir, model, steps), *mesh], run_dir.parent, timeout=600, torchrun_nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"measured": json.loads((run_dir / "host_memory.json").read_text()),
            "plan": json.loads((run_dir / "plan.json").read_text()), "log": proc.stdout + proc.stderr}


@pytest.mark.slow  # three 2-rank runs of a 226 MB model: about a minute
@pytest.mark.parametrize("mesh", [("dist.strategy=fsdp",), ("dist.tp.size=2",)], ids=["fsdp", "tp2"])
def test_loading_a_200_mb_model_holds_its_share_on_each_rank(saved, tmp_path, mesh):
    size = _model_mb(saved)
    assert size > 200
    run = _run(saved, tmp_path / "run", *mesh)
    predicted = run["plan"]["load_host_peak_mb"]
    for rank, mb in enumerate(run["measured"]["load_host_peak_mb"]):
        assert mb < 0.6 * size, f"rank {rank} added {mb:.0f} MiB to load a {size:.0f} MiB model"
        assert abs(mb - predicted) <= 0.1 * predicted, f"rank {rank}: measured {mb:.0f} MiB, plan {predicted:.0f}"
    assert "host memory added by the model's load" in run["log"]
    # The export walks the model one tensor at a time: each rank adds at most the plan's bound (copies of the
    # largest tensor whole, made by its gathers), never a share of the model.
    bound = run["plan"]["export_host_peak_mb"]
    for rank, mb in enumerate(run["measured"]["export_host_peak_mb"]):
        assert mb <= 1.1 * bound and mb < 0.6 * size, f"rank {rank}: export added {mb:.0f} MiB (plan {bound:.0f})"


@pytest.mark.slow
def test_ddp_builds_the_whole_model_on_every_rank(saved, tmp_path):
    size = _model_mb(saved)
    run = _run(saved, tmp_path / "run")
    # every rank builds the whole model with from_pretrained, as every mesh did before (plan mode's figure is
    # an estimate there: what transformers' loader maps depends on its version)
    for rank, mb in enumerate(run["measured"]["load_host_peak_mb"]):
        assert mb > size, f"rank {rank}: {mb:.0f} MiB for a {size:.0f} MiB model built whole"


# 4.5x smaller (48 MiB): the same vocabulary and data, so the difference between the two runs' peaks is what the
# model's size adds to a rank.
QWEN2_SMALL = {**QWEN2, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
               "num_attention_heads": 6, "num_key_value_heads": 2}
SGD = ("optim=sgd", "optim.momentum=0")  # no optimizer state: weights and gradients


@pytest.mark.slow  # three more 2-rank runs of three steps: about 2 minutes
def test_through_the_steps_fsdp_adds_about_a_shard_of_the_model_and_less_than_ddp(saved, tmp_path):
    import transformers

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("qwen2", **QWEN2_SMALL),
                                                  dtype=torch.float32).save_pretrained(saved / "small")
    added_size = _model_mb(saved) - _model_mb(saved, "small")
    runs = {name: _run(saved, tmp_path / name.replace(" ", "_"), *mesh, *SGD, model=model, steps=3)
            for name, model, mesh in (("ddp", "qwen2", ()), ("fsdp small", "small", ("dist.strategy=fsdp",)),
                                      ("fsdp", "qwen2", ("dist.strategy=fsdp",)))}
    peaks = {name: run["measured"]["run_host_peak_mb"] for name, run in runs.items()}
    print(f"run peaks per rank (MiB): {peaks}; the larger model adds {added_size:.0f} MiB; plan: "
          f"{ {name: round(run['plan']['run_host_peak_mb']) for name, run in runs.items()} }")
    for rank in range(2):
        added = peaks["fsdp"][rank] - peaks["fsdp small"][rank]
        # A rank's half of the weights and of the gradients (1.0x together) and at the backward's end the
        # embedding's gradient with the reduce-scatter's copy of it: 1.13-1.14x measured (1.24-1.26x while the
        # bounded heap reused blocks under 1 MiB and kept their holes). Before the tied head's part was reduced in
        # its own backward (parallel/tied_head.py) and gloo's collectives lost their copies (parallel/fsdp.py):
        # 1.42-1.44x; a heap that kept every freed block (trainer.tune_malloc=reuse) 4.1-6.4x.
        assert added < 1.3 * added_size, (rank, peaks, added_size)
        assert peaks["fsdp"][rank] < peaks["ddp"][rank], (rank, peaks)
    # Plan mode's figure for the rank that holds the most, from what the process held before its model was
    # built: within 10 % (measured 0-3 %)
    for name, run in runs.items():
        predicted, measured = run["plan"]["run_host_peak_mb"], max(peaks[name])
        assert abs(measured - predicted) <= 0.1 * predicted, (name, measured, predicted)
        assert "the run's peak host memory" in run["log"] and f"(plan: {predicted:.0f} MiB)" in run["log"]


@pytest.mark.slow  # two more 2-rank runs of three steps: about a minute
def test_lora_on_a_sharded_base_adds_a_shard_of_it_and_writes_both_outputs_without_gathering_it(saved, tmp_path):
    import transformers

    if not (saved / "small").exists():
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("qwen2", **QWEN2_SMALL),
                                                      dtype=torch.float32).save_pretrained(saved / "small")
    added_size = _model_mb(saved) - _model_mb(saved, "small")
    lora = ("dist.strategy=fsdp", "model.lora.r=4", *SGD)
    runs = {model: _run(saved, tmp_path / model, *lora, model=model, steps=3) for model in ("small", "qwen2")}
    peaks = {model: run["measured"]["run_host_peak_mb"] for model, run in runs.items()}
    print(f"LoRA run peaks per rank (MiB): {peaks}; the larger base adds {added_size:.0f} MiB; plan: "
          f"{ {model: round(run['plan']['run_host_peak_mb']) for model, run in runs.items()} }")
    for model, run in runs.items():
        assert "built whole" not in run["log"], run["log"][-2000:]  # the base on the meta device, then its shards
        assert "written tensor by tensor" in run["log"]  # hf_model/ merged as each base weight arrives
        predicted, measured = run["plan"]["run_host_peak_mb"], max(peaks[model])
        assert abs(measured - predicted) <= 0.1 * predicted, (model, measured, predicted)
    for rank in range(2):
        # The rank's half of the base (0.5x) and, at the peak, the root's embedding gathered for the embedding's
        # forward or the head's, or one frozen layer gathered (each its own unit): 0.62x measured. 0.95-0.96x
        # while each block was one unit, gathered ahead and copied out of its gather buffer, the root held
        # gathered from the embedding to the head and through the backward, and the heap kept the holes of
        # blocks under 1 MiB; 1.07-1.09x while gloo's all-gather kept a copy of each unit; 2.75x built whole on
        # every rank and exported from a whole copy.
        assert peaks["qwen2"][rank] - peaks["small"][rank] < 0.7 * added_size, (rank, peaks, added_size)
    run_dir = tmp_path / "qwen2"
    assert (run_dir / "hf_adapter" / "adapter_model.safetensors").exists() and (run_dir / "hf_model").is_dir()
