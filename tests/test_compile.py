"""trainer.compile: the compiled step is the eager step, and nothing compiles again after warm-up.

Real inductor compilation on CPU, real gloo ranks, a tiny GPT compiled block
by block:

* fp32, 2 ranks x micro 4 x accum 4, ddp: compiled and eager losses agree
  within 1e-4 relative, gradients within the compiler's rounding; the
  compiled split equals the compiled one-process batch of 32 (split
  invariance holds compiled); fsdp with activation checkpointing,
  bf16-master, and hsdp (2 replicas, reshard=step) compiled agree with their
  eager runs;
* the real loop over two epoch boundaries (a short last step of 3 samples a
  rank), with evaluation every 2 steps: no recompilation after step 1, and the
  count is in metrics.jsonl; a micro-batch of one sample compiles once more
  and says so in the log.

Marked slow (compilation costs tens of seconds here); .ci/run runs it.
"""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Subset

from dist_trainer import distributed
from dist_trainer.compiling import compiled_frames
from dist_trainer.config import BatchConfig, Config, DistConfig, OptimConfig, PrecisionConfig, TrainerConfig
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.data.builtin import char_text
from dist_trainer.run import build, train
from helpers import assert_all_close_scaled, run_ranks

pytestmark = pytest.mark.slow

GLOBAL, STEPS = 32, 2
GPT = {"_target_": "dist_trainer.models.GPT", "vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 2,
       "n_embd": 16, "dropout": 0.0, "bias": False}


def tiny_text(n: int = 256, split: str = "train") -> Subset:
    """``n`` windows of 16 bytes of the reference text (8 held out for evaluation)."""
    return Subset(char_text(block_size=16, split=split), range(n if split == "train" else 8))


def config(micro: int, compile: bool, strategy: str = "ddp", precision: str = "fp32", ac: bool = False,
           n: int = 256, steps: int = STEPS, shard_size=None, reshard: str = "micro_batch", tp: int = 1,
           cp: int = 1) -> Config:
    cfg = Config(
        model=dict(GPT), data={"_target_": f"{__name__}.tiny_text", "n": n, "split": "train", "shuffle": True},
        batch=BatchConfig(micro_batch_size=micro, global_batch_size=GLOBAL),
        precision=PrecisionConfig(name=precision),
        # SGD: a parameter's change is its gradient's (Adam would turn the rounding of a near-zero
        # gradient, e.g. of a rare byte's embedding, into a full lr-sized step either way).
        optim=OptimConfig(name="sgd", lr=0.5, momentum=0.0, weight_decay=0.0, warmup_steps=0, schedule="constant",
                          grad_clip=1.0),
        trainer=TrainerConfig(max_steps=steps, log_every=1, eval_every=0, compile=compile),
        dist=DistConfig(strategy=strategy, activation_checkpointing=ac),
    )
    cfg.dist.fsdp.shard_size, cfg.dist.fsdp.reshard = shard_size, reshard
    cfg.dist.tp.size = tp
    cfg.dist.cp.size = cp
    return cfg


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def _steps(cfg: Config, world: int) -> dict:
    frames = compiled_frames()
    parts = build(cfg, validate(cfg, world), distributed.init("cpu"))
    module, rec = parts.trainer.module, {"loss": [], "grads": []}
    for step, (window, batches) in zip(range(1, STEPS + 1),
                                       epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)):
        outcome = parts.trainer.train_step(batches, window, step)
        rec["loss"].append(outcome.loss)
        rec["grads"].append({name: _full(p.grad) for name, p in module.named_parameters() if p.grad is not None})
    rec["params"] = {name: _full(p) for name, p in module.named_parameters()}
    rec["graphs"] = compiled_frames() - frames  # what this job compiled (the count is the process's)
    del parts
    gc.collect()
    return rec


JOBS = {
    "eager": dict(compile=False),
    "compiled": dict(compile=True),
    "eager-fsdp-ac": dict(compile=False, strategy="fsdp", ac=True),
    "compiled-fsdp-ac": dict(compile=True, strategy="fsdp", ac=True),
    "eager-bf16-master": dict(compile=False, precision="bf16-master"),
    "compiled-bf16-master": dict(compile=True, precision="bf16-master"),
    # hsdp on 2 ranks: 2 replicas of shard groups of one, kept gathered through the step
    "eager-hsdp-step": dict(compile=False, strategy="fsdp", shard_size=1, reshard="step"),
    "compiled-hsdp-step": dict(compile=True, strategy="fsdp", shard_size=1, reshard="step"),
    # tp 2 on 2 ranks (one data-parallel rank, accum 8), sequence parallelism and the sharded loss
    "eager-tp": dict(compile=False, tp=2),
    "compiled-tp": dict(compile=True, tp=2),
    # cp 2 on 2 ranks (ring, zigzag): the ring's exchanges run between the compiled parts of each block
    "eager-cp": dict(compile=False, cp=2),
    "compiled-cp": dict(compile=True, cp=2),
}


def _worker(rank: int, world: int, root: str) -> dict:
    results = {name: _steps(config(4, **kw), world) for name, kw in JOBS.items()}
    # The real loop: 70 samples = steps of 32, 32, 6 (3 a rank: one micro-batch of 3), eval every 2 steps.
    cfg = config(4, True, n=70, steps=7)
    cfg.data["split"] = "train"
    cfg.trainer.eval_every, cfg.trainer.eval_batches = 2, 2
    train(cfg, Path(root) / "loop")
    return results


@pytest.fixture(scope="module", autouse=True)
def _own_inductor_cache(tmp_path_factory):
    """Compile into a cache of this module's own, for every test here and the ranks it spawns.

    Inductor's cache does not key its entries on ATEN_CPU_CAPABILITY: a cache
    filled under one instruction set's kernels, reused under another (the
    suite runs under each), gave a NaN loss in the first compiled step.
    """
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        # Kernels compile in each rank's own process: no pool of compile workers per rank, which on 2 cores
        # buys nothing and is one more set of processes that can outlive a failed test.
        mpatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    return run_ranks(_worker, 2, root, str(root)), root


def _close(got: dict, ref: dict, what: str) -> None:
    assert_all_close_scaled({name: got[name] for name in ref}, ref, what)


def test_compiled_steps_equal_eager_steps(ranks):
    results = ranks[0][0]
    for name in ("compiled", "compiled-fsdp-ac", "compiled-bf16-master", "compiled-hsdp-step", "compiled-tp",
                 "compiled-cp"):
        eager, compiled = results[name.replace("compiled", "eager")], results[name]
        for a, b in zip(compiled["loss"], eager["loss"]):
            assert abs(a - b) <= 1e-4 * abs(b), (name, compiled["loss"], eager["loss"])
    # fp32: the compiled kernels reorder float sums, nothing more.
    for step in range(STEPS):
        _close(results["compiled"]["grads"][step], results["eager"]["grads"][step], f"step {step + 1}")
    _close(results["compiled"]["params"], results["eager"]["params"], "params")
    _close(results["compiled-fsdp-ac"]["params"], results["eager-fsdp-ac"]["params"], "fsdp params")
    _close(results["compiled-hsdp-step"]["params"], results["eager-hsdp-step"]["params"], "hsdp params")
    _close(results["eager-hsdp-step"]["params"], results["eager"]["params"], "hsdp vs ddp params")
    _close(results["compiled-tp"]["params"], results["eager-tp"]["params"], "tp params")
    _close(results["eager-tp"]["params"], results["eager"]["params"], "tp vs ddp params")
    assert results["compiled-tp"]["graphs"] > 0  # the blocks compiled, DTensor and all
    _close(results["compiled-cp"]["params"], results["eager-cp"]["params"], "cp params")
    _close(results["eager-cp"]["params"], results["eager"]["params"], "cp vs ddp params")
    assert results["compiled-cp"]["graphs"] > 0


def test_split_invariance_holds_compiled(ranks):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        big = _steps(config(GLOBAL, True), 1)
    finally:
        dist.destroy_process_group()
    split = ranks[0][0]["compiled"]
    for a, b in zip(split["loss"], big["loss"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    _close(split["params"], big["params"], "2x4x4 vs 1x32x1 compiled")


def test_no_recompilation_over_epoch_boundaries_and_evaluations(ranks):
    records = [json.loads(line) for line in (ranks[1] / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 0, 0, 1, 1, 1, 2]  # two short last steps crossed
    assert sum("eval_loss" in r for r in records) == 4
    assert records[0]["compiled_graphs"] >= 1
    assert [r["recompiles"] for r in records] == [0] * 7, records
    assert records[-1]["compiled_graphs"] == records[0]["compiled_graphs"]


def test_a_one_sample_micro_batch_compiles_once_more_and_says_so(caplog):
    from dist_trainer.compiling import CompileWatch
    from dist_trainer.parallel.blocks import compile_blocks
    from dist_trainer.models import GPT as Model

    torch.manual_seed(0)
    model = Model(**{k: v for k, v in GPT.items() if k != "_target_"})
    compile_blocks(list(model.blocks), model)
    watch = CompileWatch(True, True)

    def step(batch_size: int, number: int) -> dict:
        ids = torch.randint(0, 256, (batch_size, 16))
        model({"input_ids": ids, "targets": ids})["loss_sum"].backward()
        return watch.after_step(number, 0.0)

    with caplog.at_level(logging.INFO, logger="dist_trainer"):
        assert step(8, 1)["recompiles"] == 0
        assert step(5, 2)["recompiles"] == 0  # a shorter micro-batch: the batch dimension is dynamic
        assert step(1, 3)["recompiles"] == 1  # size 1 is always specialised
        assert step(1, 4)["recompiles"] == 1 and step(3, 5)["recompiles"] == 1  # both cached now
    assert "step 3: torch.compile compiled 1 more graph(s)" in caplog.text
