"""batch.micro_batch_size=auto: ranks agree on the size even when only one runs out of memory."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.utils.data import default_collate

from dist_trainer.finder import find_micro_batch_size, largest_divisor_at_most
from helpers import run_module, run_ranks


def _finder_worker(rank, world_size, limits, cap):
    tried = []

    def trial(size):
        tried.append(size)
        if size > limits[rank]:  # this rank alone "runs out of memory"
            raise torch.OutOfMemoryError(f"simulated: {size} samples do not fit on rank {rank}")

    return find_micro_batch_size(trial, cap, torch.device("cpu")), tried


def test_ranks_agree_when_only_one_rank_runs_out_of_memory(tmp_path):
    (size0, tried0), (size1, tried1) = run_ranks(_finder_worker, 2, tmp_path, [1000, 24], 256)
    assert size0 == size1 == 24  # rank 1's limit, found by doubling then bisecting
    assert tried0 == tried1 == [1, 2, 4, 8, 16, 32, 24, 28, 26, 25]  # the same search on both ranks


def test_limit_and_nothing_fits(tmp_path):
    (capped, _), _ = run_ranks(_finder_worker, 2, tmp_path / "cap", [1000, 1000], 48)
    assert capped == 48
    (none, _), _ = run_ranks(_finder_worker, 2, tmp_path / "none", [0, 1000], 48)
    assert none == 0


def test_chosen_size_divides_the_per_rank_batch():
    assert largest_divisor_at_most(96, 40) == 32
    assert largest_divisor_at_most(96, 24) == 24
    assert largest_divisor_at_most(7, 5) == 1


def test_auto_on_cpu_refuses_with_the_key_to_change(tmp_path):
    proc = run_module(["batch.micro_batch_size=auto", "batch.global_batch_size=64", f"hydra.run.dir={tmp_path}"],
                      cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "batch.micro_batch_size=auto measures GPU memory" in proc.stdout + proc.stderr


def test_a_trial_leaves_running_statistics_and_random_streams_as_they_were():
    # BatchNorm updates its running statistics in a training forward and dropout
    # draws from the RNG: after the search, training must start as it would have
    # with the chosen size given explicitly.
    from dist_trainer.finder import model_trial

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                           torch.nn.Linear(8, 1))

        def forward(self, batch):
            return torch.nn.functional.mse_loss(self.net(batch["x"]).squeeze(-1), batch["y"])

    torch.manual_seed(0)
    model = Net().train()
    data = [{"x": torch.randn(4), "y": torch.randn(())} for _ in range(16)]
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}
    rng = torch.get_rng_state()
    trial = model_trial(model, data, nullcontext, list(model.parameters()), 2, torch.device("cpu"))
    for size in (2, 8, 16):  # BatchNorm needs 2 samples in training mode
        trial(size)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in buffers.items())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    # Guard: the trial did move them while it ran (so restoring them is what kept them).
    model(default_collate(data[:8]))
    assert not torch.equal(model.state_dict()["net.1.running_mean"], buffers["net.1.running_mean"])


def test_auto_with_sync_batchnorm_is_refused_before_training(tmp_path):
    proc = run_module(["batch.micro_batch_size=auto", "batch.global_batch_size=64", "dist.sync_batchnorm=true",
                       f"hydra.run.dir={tmp_path}"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "batch.micro_batch_size='auto': cannot be used with dist.sync_batchnorm=true" in proc.stdout + proc.stderr


def test_plan_mode_with_auto_does_not_present_the_provisional_micro_batch(tmp_path):
    plan = run_module(["plan.only=true", "plan.world_size=8", "batch.micro_batch_size=auto",
                       "batch.global_batch_size=512", f"hydra.run.dir={tmp_path}/a"], cwd=tmp_path, timeout=60)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "micro batch auto (the largest that fits, chosen on the GPU at start-up)" in plan.stdout
    assert "micro batch 1 x" not in plan.stdout and "accum steps 64 x" not in plan.stdout
    # A global batch the ranks cannot share is named as such, not as a micro batch the user never set.
    bad = run_module(["plan.only=true", "plan.world_size=8", "batch.micro_batch_size=auto",
                      "batch.global_batch_size=100", f"hydra.run.dir={tmp_path}/b"], cwd=tmp_path, timeout=60)
    assert bad.returncode == 2
    assert "batch.global_batch_size=100: must be a positive multiple of the world size 8" in bad.stdout + bad.stderr
    assert "batch.micro_batch_size=1" not in bad.stdout + bad.stderr
