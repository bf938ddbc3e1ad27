"""dist.check_consistency_every: ranks whose tensors differ are caught, and the tensor is named."""

from __future__ import annotations

import gc

import pytest
import torch

from dist_trainer import distributed
from dist_trainer.validation import validate
from dist_trainer.data import epoch_batches
from dist_trainer.parallel import ConsistencyError, check_consistency
from dist_trainer.run import build
from helpers import regression_config, run_ranks


def _worker(rank, world_size, precision):
    cfg = regression_config(micro=4, accum=2, steps=1, precision=precision)
    parts = build(cfg, validate(cfg, world_size), distributed.init("cpu"))
    trainer = parts.trainer
    window, batches = next(iter(epoch_batches(parts.train_set, parts.step_plan, 0, 0, 0, False)))
    trainer.train_step(batches, window, 1)
    outcome = {}
    check_consistency(trainer.consistency_tensors(), 1)  # in sync after a real step: passes
    outcome["clean"] = "passed"
    if precision.endswith("master"):
        target = trainer.weights.masters[2]  # desynchronise only an FP32 master
    else:
        target = dict(trainer.model.module.named_parameters())["net.2.weight"]
    if rank == 1:
        with torch.no_grad():
            flat = target.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))  # one ulp
    try:
        check_consistency(trainer.consistency_tensors(), 2)
        outcome["desync"] = "not caught"
    except ConsistencyError as err:
        outcome["desync"] = str(err)
    del parts, trainer, target
    gc.collect()
    return outcome


@pytest.mark.parametrize("precision", ["fp32", "bf16-master"])
def test_one_ulp_of_difference_is_caught_on_every_rank_and_named(tmp_path, precision):
    results = run_ranks(_worker, 2, tmp_path, precision)
    expected = "net.2.weight" if precision == "fp32" else "net.2.weight (FP32 master)"
    for r in results:
        assert r["clean"] == "passed"
        assert f"step 2: {expected} is not bit-identical" in r["desync"], r["desync"]
