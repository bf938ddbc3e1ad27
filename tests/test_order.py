"""The sample order: a permutation evaluated position by position, the same whatever the split.

Exhaustive for small sizes, sampled for large ones; neighbouring positions
uncorrelated; every split of a step takes the same samples; a resume at step
k continues the very windows a run from step 0 has there (also for a billion
samples, where nothing could be materialised); the sampler's length is the
number of micro-batches it yields.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dist_trainer.validation import validate
from dist_trainer.data.loader import SampleOrder, StepPlan, _MicroBatchSampler, hash_key
from helpers import regression_config


@pytest.mark.parametrize("key", [0, 1, 2**62 + 12345])
def test_every_size_up_to_300_is_a_permutation(key):
    for n in itertools.chain(range(1, 301), (1023, 1024, 1025, 4096, 65537)):
        order = SampleOrder(n, key)(np.arange(n))
        assert np.array_equal(np.sort(order), np.arange(n)), n


def test_no_shuffle_is_the_identity_and_keys_give_other_orders():
    assert np.array_equal(SampleOrder(1000, None)(np.arange(1000)), np.arange(1000))
    a, b = SampleOrder(1000, hash_key(0, 0))(np.arange(1000)), SampleOrder(1000, hash_key(0, 1))(np.arange(1000))
    assert not np.array_equal(a, b)  # another epoch, another order
    assert np.array_equal(a, SampleOrder(1000, hash_key(0, 0))(np.arange(1000)))  # deterministic


@pytest.mark.parametrize("n", [10**9, 10**12 + 39])
def test_large_sizes_sampled(n):
    order = SampleOrder(n, 7)
    rng = np.random.default_rng(0)
    positions = np.unique(rng.integers(0, n, size=200_000))
    values = order(positions)
    assert values.min() >= 0 and values.max() < n
    assert np.unique(values).size == positions.size  # injective on the sample
    assert np.array_equal(order(positions[:1000]), values[:1000])  # the same value whatever else is asked


def test_neighbouring_positions_are_not_correlated():
    n = 100_003
    values = SampleOrder(n, 1)(np.arange(n)).astype(float)
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.02
    assert abs(np.corrcoef(np.arange(n), values)[0, 1]) < 0.02
    # a step's samples spread over the whole dataset: each global batch of 64 covers every quarter
    quarters = (values[:64 * 100].reshape(100, 64) // (n / 4)).astype(int)
    assert all(len(set(q)) == 4 for q in quarters)


def _plan(n: int, world: int, micro: int, glob: int, rank: int) -> StepPlan:
    return StepPlan(n, validate(regression_config(micro=micro, glob=glob), world), rank, 0, True, False)


def test_every_split_takes_the_same_samples_and_a_resume_continues_the_same_windows():
    n = 1001  # 31 full steps of 32 and a short one of 9
    ref = [sorted(i for mb in w for i in mb) for w in _plan(n, 1, 32, 32, 0).windows(3)]
    for world, micro in ((2, 4), (4, 2), (2, 16)):
        plans = [_plan(n, world, micro, 32, r) for r in range(world)]
        per_rank = [list(p.windows(3)) for p in plans]
        for step in range(len(ref)):
            got = sorted(i for windows in per_rank for mb in windows[step] for i in mb)
            assert got == ref[step]
        for plan, windows in zip(plans, per_rank):
            assert list(plan.windows(3, start_step=17)) == windows[17:]
            assert len(_MicroBatchSampler(plan, 3, 5, 0)) == sum(len(w) for w in windows[5:])
    assert sorted(i for step in ref for i in step) == list(range(n))  # each sample once per epoch


def test_a_billion_samples_start_and_resume_anywhere():
    n = 10**9
    plans = [_plan(n, 2, 8, 64, r) for r in range(2)]
    windows = [next(p.windows(0, start_step=10**6)) for p in plans]  # no epoch-sized work
    samples = [i for w in windows for mb in w for i in mb]
    assert len(samples) == len(set(samples)) == 64 and max(samples) < n
    order = SampleOrder(n, hash_key(0, 0))
    assert sorted(samples) == sorted(order(np.arange(64 * 10**6, 64 * (10**6 + 1))).tolist())
