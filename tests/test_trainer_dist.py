"""The optimizer step under real DDP on gloo, compared with one process and one big batch."""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_trainer import distributed
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.run import build, train
from helpers import (RegressionMLP, assert_all_close_scaled, assert_close_scaled, job_record, regression_config,
                     run_jobs, run_ranks)


class GradSnoopMLP(nn.Module):
    """An MLP that records its parameters' local .grad at the start of every forward."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 1))
        self.snapshots = []

    def forward(self, batch):
        self.snapshots.append([None if p.grad is None else p.grad.clone() for p in self.parameters()])
        return nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])


class PoisonMLP(nn.Module):
    """Returns an infinite loss on one chosen forward call of one chosen rank."""

    def __init__(self, poison_rank: int, poison_call: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.poison_rank, self.poison_call, self.calls = poison_rank, poison_call, 0

    def forward(self, batch):
        self.calls += 1
        loss = nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1).float(), batch["y"])
        if dist.get_rank() == self.poison_rank and self.calls == self.poison_call:
            loss = loss * float("inf")
        return loss


def _steps(parts, count):
    batches = epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)
    for step, (window, micro_batches) in zip(range(1, count + 1), batches):
        yield step, parts.trainer.train_step(micro_batches, window, step)


# --------------------------------------------------------------------------- one launch for the file's 2-rank jobs

def _split_config():
    return regression_config(micro=4, glob=32, steps=3)


def _job(env, world_size, name, fn, *args):
    """run_jobs' runner: a job is one of this file's rank functions and its arguments."""
    return {"result": fn(env.rank, world_size, *args)}


@pytest.fixture(scope="module")
def ranks2(tmp_path_factory):
    """Every 2-rank job of this file in one launch (helpers.run_jobs: a job that raises fails only its tests);
    the job that guards against a hang (a rank without held-out samples) keeps a launch of its own."""
    root = tmp_path_factory.mktemp("ranks2")
    jobs = [("snoop4", _snoop_worker, 4), ("snoop1", _snoop_worker, 1), ("naive", _naive_sync_worker),
            ("split", _train_worker, _split_config(), str(root / "split")), ("skip", _skip_worker),
            ("views", _grad_storages_worker, False), ("unused", _grad_storages_worker, True)]
    results = run_ranks(run_jobs, 2, root, jobs, _job, timeout=LAUNCH_TIMEOUT_S)
    return SimpleNamespace(root=root, get=lambda name: [job_record(r, name)["result"] for r in results])


LAUNCH_TIMEOUT_S = 240  # the merged launch: a hang fails its tests instead of blocking the suite


def _snoop_worker(rank, world_size, accum):
    cfg = regression_config(micro=4, accum=accum, steps=2)
    cfg.model = {"_target_": f"{__name__}.GradSnoopMLP"}
    env = distributed.init("cpu")
    parts = build(cfg, validate(cfg, world_size), env)
    calls = [outcome.allreduces for _, outcome in _steps(parts, 2)]
    model = parts.trainer.model.module
    result = {
        "calls": calls,
        # Private, test-only: DDP exposes its bucket layout nowhere else.
        "buckets": len(parts.trainer.model._get_ddp_logging_data()["bucket_sizes"].split(",")),
        "step2_snapshots": model.snapshots[accum:],  # taken before each micro-batch of step 2
        "final_grads": [p.grad.clone() for p in model.parameters()],
    }
    del parts, model
    gc.collect()
    return result


def test_one_allreduce_per_bucket_per_step_and_local_grads_differ_until_the_last(ranks2):
    accum4, accum1 = ranks2.get("snoop4"), ranks2.get("snoop1")
    for rank in range(2):
        # As many all-reduces as DDP has buckets, with 4 micro-batches as with 1.
        assert accum4[rank]["calls"] == accum1[rank]["calls"]
        assert accum4[rank]["calls"][-1] == accum4[rank]["buckets"] >= 1
    # Before micro-batches 2..4 each rank holds only its own partial sum: they differ.
    snaps0, snaps1 = accum4[0]["step2_snapshots"], accum4[1]["step2_snapshots"]
    # zeroed at the start of the step: in place, as they are views of DDP's buckets (gradient_as_bucket_view)
    assert all(g is not None and not g.any() for g in snaps0[0])
    for k in (1, 2, 3):
        assert not any(torch.equal(a, b) for a, b in zip(snaps0[k], snaps1[k]))
    # After the last backward they are all-reduced: bit-identical.
    for a, b in zip(accum4[0]["final_grads"], accum4[1]["final_grads"]):
        assert torch.equal(a, b)


def test_counter_sees_every_allreduce_without_no_sync(ranks2):
    """Guard for the test above: the counter is not blind to extra all-reduces."""
    results = ranks2.get("naive")
    assert results[0] == results[1] == 4


def _naive_sync_worker(rank, world_size):
    cfg = regression_config(micro=4, accum=1, steps=1)
    cfg.model = {"_target_": f"{__name__}.GradSnoopMLP"}
    env = distributed.init("cpu")
    parts = build(cfg, validate(cfg, world_size), env)
    model, counter = parts.trainer.model, parts.trainer.strategy.counter
    x = {"x": torch.randn(4, 4), "y": torch.randn(4), "use_branch": torch.zeros(4, dtype=torch.bool)}
    model(x).backward()  # first iteration: DDP rebuilds its buckets after it
    before = counter.calls
    for _ in range(4):  # 4 micro-batches, no no_sync: 4 all-reduces per bucket
        model(x).backward()
    calls = (counter.calls - before) // len(model._get_ddp_logging_data()["bucket_sizes"].split(","))
    del parts, model
    gc.collect()
    return calls


def _train_worker(rank, world_size, cfg, run_dir):
    train(cfg, Path(run_dir))


def test_two_ranks_times_accumulation_equal_one_big_batch(ranks2, tmp_path):
    # Why the data order makes this hold: every optimizer step takes the same 32
    # samples (a slice of one seeded permutation, independent of the world size),
    # and only how they are dealt to ranks and micro-batches changes; the update
    # is the gradient of their mean either way.
    big = regression_config(micro=32, accum=1, steps=3)
    train(big, tmp_path / "big")  # one process, in this one
    ranks2.get("split")  # the launch's 2 ranks x micro 4 (_split_config)
    ref = torch.load(tmp_path / "big" / "final_model.pt", weights_only=True)
    got = torch.load(ranks2.root / "split" / "final_model.pt", weights_only=True)
    assert ref.keys() == got.keys()
    assert_all_close_scaled(got, ref, "2 ranks x micro 4 vs 1 x 32")
    # Guard: the comparison is between trained weights, not two copies of the init.
    torch.manual_seed(big.trainer.seed)
    init = RegressionMLP(4, 16).state_dict()
    assert not torch.allclose(init["net.0.weight"], ref["net.0.weight"], rtol=1e-3)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _skip_worker(rank, world_size):
    cfg = regression_config(micro=4, accum=2, steps=3, precision="fp16-mixed", warmup_steps=5)
    cfg.precision.loss_scale.init_scale = 1024.0  # low enough that only the poison overflows
    cfg.precision.debug_overflow = True
    collect = _Collect()
    logging.getLogger("dist_trainer").addHandler(collect)
    # Rank 1's 3rd forward is the first micro-batch of step 2 (accum 2).
    cfg.model = {"_target_": f"{__name__}.PoisonMLP", "poison_rank": 1, "poison_call": 3}
    env = distributed.init("cpu")
    parts = build(cfg, validate(cfg, world_size), env)
    params, outcomes = [], []
    for _, outcome in _steps(parts, 3):
        outcomes.append(outcome)
        params.append([p.detach().clone() for p in parts.trainer.model.parameters()])
    result = {"params": params, "outcomes": outcomes, "updates": parts.trainer.updates,
              "log": list(collect.messages)}
    logging.getLogger("dist_trainer").removeHandler(collect)  # the launch's next job logs to its own
    del parts
    gc.collect()
    return result


def test_fp16_nonfinite_gradient_on_one_rank_skips_the_step_on_all_ranks(ranks2):
    results = ranks2.get("skip")
    for r in results:
        skipped = [o.skipped for o in r["outcomes"]]
        assert skipped == [False, True, False]
        assert [o.skip_reason for o in r["outcomes"]] == [None, "nonfinite", None]
        p1, p2, p3 = r["params"]
        assert all(torch.equal(a, b) for a, b in zip(p1, p2))  # step 2 changed nothing
        assert not all(torch.equal(a, b) for a, b in zip(p2, p3))
        scales = [o.loss_scale for o in r["outcomes"]]
        assert scales[0] == scales[1] == 1024.0 and scales[2] == 512.0  # backed off once
        lrs = [o.lr for o in r["outcomes"]]
        assert lrs[0] < lrs[1] and lrs[1] == lrs[2]  # warmup did not advance on the skip
        assert r["updates"] == 2
        # precision.debug_overflow names the parameters whose gradients overflowed
        assert r["log"] == ["step 2: non-finite gradients in net.0.weight, net.0.bias, net.2.weight, net.2.bias"]
    for a, b in zip(results[0]["params"][-1], results[1]["params"][-1]):
        assert torch.equal(a, b)


def _partial_step_update(policy):
    """Parameters before and after the epoch's short last step (6 of 32 samples)."""
    cfg = regression_config(micro=8, glob=32, steps=3, n=70, name="sgd", lr=1.0, momentum=0.0,
                            weight_decay=0.0, warmup_steps=0, schedule="constant", grad_clip=None)
    cfg.batch.partial_step = policy
    parts = build(cfg, validate(cfg, 1), distributed.init("cpu"))
    model = parts.trainer.model.module
    for step, outcome in _steps(parts, 3):
        if step == 2:
            before = [p.detach().clone() for p in model.parameters()]
    after = [p.detach().clone() for p in model.parameters()]
    samples = outcome.samples
    del parts, model
    gc.collect()
    return before, after, samples


def test_partial_step_scaled_weighs_a_short_last_step_by_its_samples():
    try:
        before_m, after_m, samples = _partial_step_update("mean")
        before_s, after_s, _ = _partial_step_update("scaled")
    finally:
        dist.destroy_process_group()
    assert samples == 6  # 70 = 32 + 32 + 6
    for b_m, a_m, b_s, a_s in zip(before_m, after_m, before_s, after_s):
        assert torch.equal(b_m, b_s)  # the two full steps are the same under both policies
        # SGD with lr 1: the update is minus the gradient; "scaled" is "mean" x 6/32, to the rounding
        # of parameter - parameter: 6e-8 of parameters of about 1, against updates of 2e-3 or more.
        assert_close_scaled(a_s - b_s, (a_m - b_m) * 6 / 32, "scaled vs mean x 6/32", tol=1e-4)
        assert (a_m - b_m).abs().max() > 1e-2  # the step did move the parameters


def split_regression(split: str = "train", n: int = 32, n_val: int = 1, in_dim: int = 4):
    """The regression data with a held-out split of ``n_val`` samples (drawn from another seed)."""
    from dist_trainer.data.builtin import regression

    return regression(n=n, in_dim=in_dim) if split == "train" else regression(n=n_val, in_dim=in_dim, seed=1)


@pytest.mark.timeout(120)  # the bug this guards against is a hang: fail instead of waiting 30 minutes
def test_a_rank_without_held_out_samples_still_joins_the_evaluation(tmp_path):
    # One held-out sample on 2 ranks: rank 1's eval loader has no batch at all. It
    # must still join evaluate()'s all-reduce, or rank 0 waits for it forever.
    cfg = regression_config(micro=4, glob=16, steps=2)
    cfg.data = {"_target_": f"{__name__}.split_regression", "split": "train", "n": 32, "n_val": 1, "shuffle": True}
    cfg.trainer.eval_every, cfg.trainer.eval_batches = 1, 2
    run_ranks(_train_worker, 2, tmp_path, cfg, str(tmp_path / "run"))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # The evaluation of the last step is the final model's loss on that one sample.
    model = RegressionMLP(4, 16)
    model.load_state_dict(torch.load(tmp_path / "run" / "final_model.pt", weights_only=True))
    val = split_regression("val")
    with torch.no_grad():
        expected = model({k: v.unsqueeze(0) for k, v in val[0].items()}).item()
    assert records[-1]["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert records[0]["eval_loss"] != pytest.approx(expected, rel=1e-3)  # the first was of another model


class RandomTransform(torch.utils.data.Dataset):
    """Each item is one draw of the process's RNG: a random augmentation, reduced to its essence."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.rand(())


def _worker_draws(seed: int, rank: int, epoch: int = 0, start_step: int = 0) -> list:
    from dist_trainer.config import BatchPlan
    from dist_trainer.data import StepPlan

    plan = BatchPlan(world_size=2, micro_batch_size=4, accum_steps=2, global_batch_size=16, base_lr=1.0, lr=1.0,
                     max_steps=4)
    step_plan = StepPlan(64, plan, rank, seed, shuffle=True, drop_last=False)
    return [b.tolist() for _, batches in epoch_batches(RandomTransform(), step_plan, epoch, start_step, 2, False)
            for b in batches]


def test_random_transforms_in_loader_workers_differ_by_rank_seed_and_epoch():
    # DataLoader workers seed their RNG from the loader's generator: keyed on the epoch
    # alone, every rank (and every trainer.seed) would augment its samples identically.
    base = _worker_draws(seed=0, rank=0)
    assert base == _worker_draws(seed=0, rank=0)  # reproducible
    for other in (_worker_draws(seed=0, rank=1), _worker_draws(seed=7, rank=0), _worker_draws(seed=0, rank=0, epoch=1)):
        assert other != base


class WorkerPid(torch.utils.data.Dataset):
    """Each item is the pid of the process that loaded it, and the key it was asked for."""

    keyed_by_epoch = True

    def __len__(self):
        return 24

    def __getitem__(self, key):
        epoch, index = key
        return torch.tensor([os.getpid(), epoch, index])


def test_loader_workers_persist_across_epochs_and_keyed_datasets_get_the_epoch():
    from dist_trainer.config import BatchPlan
    from dist_trainer.data import StepPlan, TrainLoader

    plan = BatchPlan(world_size=1, micro_batch_size=4, accum_steps=2, global_batch_size=8, base_lr=1.0, lr=1.0,
                     max_steps=9)
    step_plan = StepPlan(24, plan, 0, 0, shuffle=True, drop_last=False)
    loader = TrainLoader(WorkerPid(), step_plan, num_workers=2)
    pids = []
    for epoch, start in ((0, 0), (1, 0), (2, 1)):  # the last: a pass resumed mid-epoch
        items = torch.cat([b for _, batches in loader.epoch(epoch, start) for b in batches])
        assert (items[:, 1] == epoch).all()  # the epoch travels with each index to the worker
        expected = [i for window in step_plan.windows(epoch, start) for mb in window for i in mb]
        assert items[:, 2].tolist() == expected
        pids.append(set(items[:, 0].tolist()))
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2]  # the same two workers served every pass
    assert os.getpid() not in pids[0]
    del loader


def _grad_storages_worker(rank, world_size, find_unused):
    cfg = regression_config(micro=4, accum=2, steps=3)
    cfg.dist.find_unused_parameters = find_unused
    parts = build(cfg, validate(cfg, world_size), distributed.init("cpu"))
    storages = []
    for _, outcome in _steps(parts, 3):
        assert not outcome.skipped
        storages.append({p.grad.untyped_storage().data_ptr() for p in parts.trainer.module.parameters()})
    buckets = len(parts.trainer.model._get_ddp_logging_data()["bucket_sizes"].split(","))
    params = len(list(parts.trainer.module.parameters()))
    del parts
    gc.collect()
    return storages, buckets, params


def test_gradients_live_in_ddps_buckets_unless_parameters_may_go_unused(ranks2):
    """dist.gradient_as_bucket_view: every step's gradients are views of the (one, here) all-reduce bucket,
    the same storage from step to step (zeroed in place); with find_unused_parameters each has its own."""
    (storages, buckets, params), _ = ranks2.get("views")
    assert buckets == 1 and params == 4
    # DDP rebuilds its buckets once, after the first step: from then on, the same storage every step
    assert [len(s) for s in storages] == [1, 1, 1] and storages[1] == storages[2]
    (storages, _, params), _ = ranks2.get("unused")
    assert all(len(s) == params for s in storages)


class HostReads:
    """Counts the reads of a tensor's value into Python (each a host sync on CUDA) while active."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __init__(self):
        self.calls: list = []
        self.paused = False

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, original in self.saved.items():
            def counting(tensor, *args, _name=name, _original=original, **kwargs):
                if not self.paused:
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


@pytest.mark.parametrize("model, strategy, precision", [
    ("mlp", "ddp", "fp32"), ("gpt", "ddp", "bf16-master"), ("gpt", "fsdp", "fp32"), ("gpt", "ddp", "fp16-mixed")])
def test_a_step_reads_one_value_to_the_host(model, strategy, precision):
    """No host sync per micro-batch: after the first step (which measures the loss divisor and the
    state size once), an optimizer step of 4 micro-batches reads tensors into Python exactly once,
    the all-reduced totals, whatever the strategy, precision or loss form. (torch.optim's own reads
    are not counted: they are of its step counters, which live on the CPU also when training on CUDA.)"""
    cfg = regression_config(micro=2, accum=4, steps=3, precision=precision)
    if model == "gpt":
        cfg.model = {"_target_": "dist_trainer.models.GPT", "vocab_size": 256, "block_size": 16, "n_layer": 1,
                     "n_head": 2, "n_embd": 16}
        cfg.data = {"_target_": "dist_trainer.data.builtin.char_text", "block_size": 16, "shuffle": True}
    cfg.dist.strategy = strategy
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        parts = build(cfg, validate(cfg, 1), distributed.init("cpu"))
        reads = []
        for step, (window, batches) in zip(range(1, 4), epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)):
            with HostReads() as counter:
                optimizer_step = parts.trainer.optimizer.step

                def uncounted(*args, **kwargs):
                    counter.paused = True
                    try:
                        return optimizer_step(*args, **kwargs)
                    finally:
                        counter.paused = False

                parts.trainer.optimizer.step = uncounted
                outcome = parts.trainer.train_step(batches, window, step)
                parts.trainer.optimizer.step = optimizer_step
            assert len(window) == 4 and not outcome.skipped
            reads.append(counter.calls)
        del parts
        gc.collect()
    finally:
        dist.destroy_process_group()
    assert reads[1] == reads[2] == ["tolist"], reads
