"""batch.micro_batch_size=auto: ranks agree on the size even when only one runs out of memory."""

from __future__ import annotations

import torch

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
