"""Tests for dist_trainer.sync_batchnorm.

The numerics are checked with two real gloo processes against plain
nn.BatchNorm run on the concatenated global batch in this (parent) process.
Only two process spawns are used (~3 s each) to keep the file fast.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_trainer.parallel.sync_batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm
from helpers import assert_all_close_scaled, assert_close_scaled, run_ranks

WORLD_SIZE = 2

# name -> (reference class, global input shape, momentum, samples per rank)
CASES = {
    "bn2d": (nn.BatchNorm2d, (16, 3, 5, 5), 0.1, (8, 8)),
    # momentum=None: cumulative moving average of the running stats.
    "bn1d_cma": (nn.BatchNorm1d, (16, 4), None, (8, 8)),
    # Rank 1 has an empty batch: it must contribute nothing yet not hang.
    "bn2d_empty_rank": (nn.BatchNorm2d, (16, 3, 5, 5), 0.1, (16, 0)),
}
ITERATIONS = 2


# ----------------------------------------------------------------- helpers


def _data(case_idx: int, it: int, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed input (non-zero mean, non-unit var) and upstream gradient."""
    gen = torch.Generator().manual_seed(1000 * case_idx + it)
    x = torch.randn(shape, generator=gen) * 2.0 + 3.0
    g = torch.randn(shape, generator=gen)  # random, so grads are not trivially 0
    return x, g


def _init_affine(bn: nn.Module, case_idx: int) -> None:
    gen = torch.Generator().manual_seed(case_idx)
    with torch.no_grad():
        bn.weight.copy_(1 + 0.5 * torch.randn(bn.num_features, generator=gen))
        bn.bias.copy_(torch.randn(bn.num_features, generator=gen))


def _rank_slice(split, rank: int) -> slice:
    start = sum(split[:rank])
    return slice(start, start + split[rank])


@pytest.fixture
def gloo_env(monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


# ----------------------------------------------------- numerics vs BatchNorm


def _numerics_worker(rank: int, world_size: int) -> dict:
    results = {}
    for idx, (name, (_, shape, momentum, split)) in enumerate(CASES.items()):
        bn = CPUSyncBatchNorm(shape[1], momentum=momentum)
        _init_affine(bn, idx)
        for it in range(ITERATIONS):
            x, g = _data(idx, it, shape)
            sl = _rank_slice(split, rank)
            x = x[sl].clone().requires_grad_()
            out = bn(x)
            (out * g[sl]).sum().backward()  # local loss: this rank's samples only
            results[f"{name}/{it}"] = {
                "out": out.detach(), "grad_in": x.grad,
                "grad_w": bn.weight.grad.clone(), "grad_b": bn.bias.grad.clone(),
            }
            bn.zero_grad()
        results[f"{name}/buffers"] = dict(bn.named_buffers())
    return results


def test_matches_batchnorm_on_global_batch(tmp_path, gloo_env) -> None:
    ranks = run_ranks(_numerics_worker, WORLD_SIZE, tmp_path, timeout=120)

    for idx, (name, (bn_cls, shape, momentum, _)) in enumerate(CASES.items()):
        ref = bn_cls(shape[1], momentum=momentum)
        _init_affine(ref, idx)
        for it in range(ITERATIONS):
            x, g = _data(idx, it, shape)
            x.requires_grad_()
            out = ref(x)
            (out * g).sum().backward()  # reference loss: sum over all 16 samples
            got = [r[f"{name}/{it}"] for r in ranks]
            assert_close_scaled(torch.cat([r["out"] for r in got]), out, f"{name} output, step {it}")
            assert_close_scaled(torch.cat([r["grad_in"] for r in got]), x.grad, f"{name} input grad, step {it}")
            # The global loss is the sum of the local losses, so the reference
            # parameter grads equal the SUM of the ranks' local grads.  We
            # compare that sum directly rather than through DDP: it isolates
            # this module (DDP averaging is covered by the DDP test below).
            assert_close_scaled(got[0]["grad_w"] + got[1]["grad_w"], ref.weight.grad, f"{name} weight grad, step {it}")
            assert_close_scaled(got[0]["grad_b"] + got[1]["grad_b"], ref.bias.grad, f"{name} bias grad, step {it}")
            ref.zero_grad()
        for r in ranks:
            buffers = r[f"{name}/buffers"]
            for key, value in ref.named_buffers():
                assert_close_scaled(buffers[key], value, f"{name} {key}")
        assert int(ref.num_batches_tracked) == ITERATIONS


# ------------------------------------------------------------ DDP training


def _small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())


def _ddp_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, _ = _data(99, 0, (16, 3, 5, 5))
    _, g = _data(99, 0, (16, 4, 5, 5))  # upstream grad has the conv's 4 channels
    return x, g


def _ddp_worker(rank: int, world_size: int) -> dict:
    # torch's own SyncBatchNorm is refused by DDP for CPU modules.
    try:
        DDP(nn.SyncBatchNorm.convert_sync_batchnorm(_small_cnn()), bucket_cap_mb=None)
        torch_error = ""
    except ValueError as e:
        torch_error = str(e)
    gc.collect()  # drop the half-built DDP before we go on

    model = convert_sync_batchnorm(_small_cnn(), torch.device("cpu"))
    ddp = DDP(model, bucket_cap_mb=None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, g = _ddp_data()
    sl = _rank_slice((8, 8), rank)
    (ddp(x[sl]) * g[sl]).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    del ddp, opt  # before destroy_process_group(), or exit may hang
    return {"grads": grads, "state": model.state_dict(), "torch_error": torch_error}


def test_ddp_cpu_model_trains_one_step(tmp_path, gloo_env) -> None:
    ranks = run_ranks(_ddp_worker, WORLD_SIZE, tmp_path, timeout=120)

    ref = _small_cnn()
    x, g = _ddp_data()
    (ref(x) * g).sum().backward()
    # DDP AVERAGES the local grads; the global loss is the sum of the two
    # local losses, so each rank must hold reference_grad / world_size.
    for p in ref.parameters():
        p.grad /= WORLD_SIZE
    expected_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    torch.optim.SGD(ref.parameters(), lr=0.1).step()

    for r in ranks:
        assert "only work with GPU modules" in r["torch_error"]
        # 0.bias sits before the BatchNorm, which removes any shift: its gradient is zero but for rounding.
        assert_all_close_scaled(r["grads"], expected_grads, "ddp grads")
        for key, value in ref.state_dict().items():  # params after step + BN buffers
            assert_close_scaled(r["state"][key], value, f"ddp state {key}")


# ------------------------------------------------- single-process behaviour


def test_convert_sync_batchnorm_cpu_replaces_and_preserves() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3, momentum=None),
                          nn.ReLU())
    bn = model[1]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.num_batches_tracked.fill_(7)
    bn.bias.requires_grad_(False)
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    expected = model(x)
    conv = model[0]

    converted = convert_sync_batchnorm(model, torch.device("cpu"))

    new_bn = converted[1]
    assert isinstance(new_bn, CPUSyncBatchNorm)
    assert converted[0] is conv and isinstance(converted[2], nn.ReLU)
    assert (new_bn.eps, new_bn.momentum, new_bn.affine, new_bn.track_running_stats) == (
        1e-3, None, True, True)
    assert not new_bn.training
    assert new_bn.weight.requires_grad and not new_bn.bias.requires_grad
    for key, value in bn.state_dict().items():
        torch.testing.assert_close(new_bn.state_dict()[key], value, rtol=0, atol=0)
    torch.testing.assert_close(converted(x), expected, rtol=0, atol=0)
    # A bare BatchNorm layer is replaced as the returned root module.
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(3), torch.device("cpu")),
                      CPUSyncBatchNorm)


def test_convert_sync_batchnorm_cuda_delegates_to_torch(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(nn.SyncBatchNorm, "convert_sync_batchnorm",
                        lambda module, group=None: calls.append((module, group)) or "torch")
    model, group = nn.Sequential(nn.BatchNorm2d(2)), object()
    assert convert_sync_batchnorm(model, torch.device("cuda"), group) == "torch"
    assert calls == [(model, group)]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train_no_dist"])
def test_equals_batchnorm_without_sync(training: bool) -> None:
    # Eval mode (and training without an initialised process group) must be
    # exactly nn.BatchNorm2d, running-stat updates included.
    assert not dist.is_initialized()
    ref, bn = nn.BatchNorm2d(3), CPUSyncBatchNorm(3)
    for m in (ref, bn):
        _init_affine(m, 0)
        with torch.no_grad():
            m.running_mean.copy_(torch.tensor([0.5, -1.0, 2.0]))
            m.running_var.copy_(torch.tensor([1.5, 0.7, 3.0]))
        m.train(training)
    x, _ = _data(0, 0, (6, 3, 5, 5))
    torch.testing.assert_close(bn(x), ref(x), rtol=0, atol=0)
    for (key, a), (_, b) in zip(bn.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)
