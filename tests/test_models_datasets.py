"""Fast tests for the built-in models and datasets (whole file well under 20 s)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from dist_trainer.data.builtin import IGNORE_INDEX, char_text, digits, reference_text_bytes, regression
from dist_trainer.models import GPT, BranchyMLP, DigitsConvNet
from helpers import assert_close_scaled


def _batch(ds, indices) -> dict[str, torch.Tensor]:
    return default_collate([ds[i] for i in indices])


# ----------------------------------------------------------------- char_text


def test_char_text_shapes_and_shift() -> None:
    ds = char_text(block_size=32)
    text = reference_text_bytes()
    assert len(text) > 400_000
    train_bytes = len(text) - round(len(text) * 0.1)
    assert len(ds) == (train_bytes - 1) // 32
    assert ds.vocab_size == 256
    for i in (0, 1, len(ds) - 1):
        item = ds[i]
        assert set(item) == {"input_ids", "targets"}
        assert item["input_ids"].shape == (32,) and item["input_ids"].dtype == torch.int64
        assert item["targets"].shape == (32,) and item["targets"].dtype == torch.int64
        assert torch.equal(item["input_ids"][1:], item["targets"][:-1])
        # Non-overlapping windows with stride block_size over the raw bytes.
        expected = torch.tensor(list(text[i * 32 : i * 32 + 33]), dtype=torch.int64)
        assert torch.equal(item["input_ids"], expected[:-1])
        assert torch.equal(item["targets"], expected[1:])
    assert int(ds[0]["input_ids"].max()) < 256
    # Consecutive windows: last target of i is the first input of i+1.
    assert ds[0]["targets"][-1] == ds[1]["input_ids"][0]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_char_text_train_val_disjoint_and_deterministic() -> None:
    text = reference_text_bytes()
    train = char_text(block_size=16, split="train", val_fraction=0.1)
    val = char_text(block_size=16, split="val", val_fraction=0.1)
    cut = len(text) - round(len(text) * 0.1)
    assert train.num_bytes == cut and val.num_bytes == len(text) - cut
    assert train.num_bytes + val.num_bytes == len(text)
    # Val starts exactly where train's bytes end: the splits' byte ranges are disjoint.
    assert torch.equal(val[0]["input_ids"], torch.tensor(list(text[cut : cut + 16])))
    # The last train window ends inside the train bytes.
    assert (len(train) - 1) * 16 + 17 <= cut
    assert len(val) == (len(text) - cut - 1) // 16
    again = char_text(block_size=16, split="val", val_fraction=0.1)
    for i in (0, len(val) // 2, len(val) - 1):
        assert torch.equal(val[i]["input_ids"], again[i]["input_ids"])


def test_char_text_validation() -> None:
    with pytest.raises(ValueError, match="data.split"):
        char_text(split="test")
    with pytest.raises(ValueError, match="data.block_size"):
        char_text(block_size=0)
    with pytest.raises(ValueError, match="data.val_fraction"):
        char_text(val_fraction=1.5)
    with pytest.raises(ValueError, match="data.min_len"):
        char_text(block_size=8, min_len=9)


def test_char_text_variable_length_mode() -> None:
    bs, min_len = 32, 8
    ds = char_text(block_size=bs, min_len=min_len)
    full = char_text(block_size=bs)
    lengths = []
    for i in range(50):
        item, ref = ds[i], full[i]
        L = ds.valid_length(i)
        lengths.append(L)
        assert min_len <= L <= bs
        assert torch.equal(item["input_ids"], ref["input_ids"])
        assert torch.equal(item["targets"][:L], ref["targets"][:L])
        assert bool((item["targets"][L:] == IGNORE_INDEX).all())
        assert int((item["targets"] != IGNORE_INDEX).sum()) == L
    assert len(set(lengths)) > 5, "lengths should vary"
    # Deterministic across instances.
    ds2 = char_text(block_size=bs, min_len=min_len)
    assert [ds2.valid_length(i) for i in range(50)] == lengths

    model = GPT(block_size=bs, n_layer=1, n_head=2, n_embd=32).eval()
    batch = _batch(ds, range(8))
    out = model(batch)
    assert out["num_items"].dtype == torch.int64 and out["num_items"].dim() == 0
    assert int(out["num_items"]) == sum(lengths[:8])
    # loss_sum only includes the non-ignored positions.
    with torch.no_grad():
        logits = model.logits(batch["input_ids"]).float()
        per_tok = torch.nn.functional.cross_entropy(
            logits.view(-1, 256), batch["targets"].view(-1), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(8, bs)
        mask = batch["targets"] != IGNORE_INDEX
        assert float(per_tok[~mask].abs().sum()) == 0.0
        assert_close_scaled(out["loss_sum"], per_tok[mask].sum(), "loss_sum vs the masked per-token sum")


# ------------------------------------------------------------------------ GPT


def test_gpt_init_loss_and_grads() -> None:
    torch.manual_seed(0)
    model = GPT()
    assert model.head.weight is model.tok_emb.weight
    batch = _batch(char_text(block_size=64), range(8))
    out = model(batch)
    assert set(out) == {"loss_sum", "num_items"}
    assert out["loss_sum"].dtype == torch.float32 and out["loss_sum"].dim() == 0
    assert out["num_items"].dtype == torch.int64 and int(out["num_items"]) == 8 * 64
    assert torch.isfinite(out["loss_sum"])
    per_tok = float(out["loss_sum"].detach()) / int(out["num_items"])
    assert abs(per_tok - math.log(256)) < 0.1 * math.log(256)
    (out["loss_sum"] / out["num_items"]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert float(model.blocks[0].attn.q.weight.grad.abs().sum()) > 0


def test_gpt_rejects_too_long_sequence() -> None:
    model = GPT(block_size=8, n_layer=1, n_head=1, n_embd=16)
    x = torch.zeros(1, 9, dtype=torch.int64)
    with pytest.raises(AssertionError, match="block_size"):
        model({"input_ids": x, "targets": x})


def test_gpt_loss_sum_is_additive_over_samples() -> None:
    torch.manual_seed(0)
    model = GPT(block_size=32, n_layer=2, n_head=2, n_embd=64).eval()
    ds = char_text(block_size=32, min_len=4)
    batch = _batch(ds, range(10))
    first = {k: v[:4] for k, v in batch.items()}
    second = {k: v[4:] for k, v in batch.items()}
    with torch.no_grad():
        whole, a, b = model(batch), model(first), model(second)
    assert_close_scaled(whole["loss_sum"], a["loss_sum"] + b["loss_sum"], "one batch vs its two halves")
    assert int(whole["num_items"]) == int(a["num_items"]) + int(b["num_items"])


def test_gpt_training_lowers_loss() -> None:
    torch.manual_seed(0)
    ds = char_text(block_size=64)
    model = GPT(n_layer=2, n_embd=64, n_head=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    eval_batch = _batch(ds, range(100, 132))

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            out = model(eval_batch)
        model.train()
        return float(out["loss_sum"]) / int(out["num_items"])

    before = eval_loss()
    it = iter(loader)
    for _ in range(30):
        out = model(next(it))
        loss = out["loss_sum"] / out["num_items"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after = eval_loss()
    print(f"GPT per-token loss {before:.3f} -> {after:.3f} nats (drop {before - after:.3f})")
    assert before - after >= 0.5, (before, after)


# --------------------------------------------------------------------- digits


def test_digits_dataset() -> None:
    train, val = digits("train"), digits("val")
    assert len(train) + len(val) == 1797
    assert len(val) == round(1797 * 0.2)
    item = train[0]
    assert item["image"].shape == (1, 8, 8) and item["image"].dtype == torch.float32
    assert item["label"].shape == () and item["label"].dtype == torch.int64
    imgs = torch.stack([val[i]["image"] for i in range(len(val))])
    assert float(imgs.min()) >= 0.0 and float(imgs.max()) <= 1.0
    assert torch.equal(digits("val")[3]["image"], val[3]["image"])
    # Disjoint: the val split is the tail, not a copy of training samples.
    assert not torch.equal(train[0]["image"], val[0]["image"])
    with pytest.raises(ValueError, match="data.split"):
        digits("test")


def test_digits_convnet_trains() -> None:
    torch.manual_seed(0)
    ds = digits("train")
    model = DigitsConvNet()
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(ds, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    losses = []
    for step, batch in enumerate(loader):
        loss = model(batch)
        assert loss.dim() == 0
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step == 14:
            break
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


# ----------------------------------------------------------- BranchyMLP / regression


def test_regression_dataset() -> None:
    ds = regression(n=20, in_dim=3, seed=1, branch_every=4)
    assert len(ds) == 20
    item = ds[0]
    assert item["x"].shape == (3,) and item["x"].dtype == torch.float32
    assert item["y"].shape == () and item["use_branch"].dtype == torch.bool
    flags = [bool(ds[i]["use_branch"]) for i in range(20)]
    assert flags == [(i // 4) % 2 == 0 for i in range(20)]
    assert not any(bool(regression(n=8)[i]["use_branch"]) for i in range(8))
    # Deterministic per seed; y is close to a fixed linear function of x.
    again, other = regression(n=20, in_dim=3, seed=1), regression(n=20, in_dim=3, seed=2)
    assert torch.equal(again[5]["x"], ds[5]["x"]) and torch.equal(again[5]["y"], ds[5]["y"])
    assert not torch.equal(other[5]["x"], ds[5]["x"])
    x = torch.stack([ds[i]["x"] for i in range(20)])
    y = torch.stack([ds[i]["y"] for i in range(20)])
    design = torch.cat([x, torch.ones(20, 1)], dim=1)
    coef = torch.linalg.lstsq(design, y.unsqueeze(1)).solution
    assert float((design @ coef).squeeze(1).sub(y).abs().max()) < 0.05


def test_branchy_mlp_unused_branch_has_no_grad() -> None:
    torch.manual_seed(0)
    ds = regression(n=16, branch_every=4)
    model = BranchyMLP()
    no_branch = _batch(ds, range(4, 8))
    assert not bool(no_branch["use_branch"].any())
    loss = model(no_branch)
    assert loss.dim() == 0
    loss.backward()
    assert model.branch.weight.grad is None
    assert model.trunk.weight.grad is not None and model.head.weight.grad is not None

    model.zero_grad(set_to_none=True)
    model(_batch(ds, range(0, 4))).backward()
    assert model.branch.weight.grad is not None


def test_gpt_state_dict_of_the_fused_qkv_layout_still_loads():
    """A state dict saved when attention had one ``qkv`` projection (queries, keys, values stacked) loads
    into the separate q, k, v: the same function, checked by the outputs."""
    torch.manual_seed(0)
    saved = GPT(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    state = saved.state_dict()
    for kind in ("weight", "bias"):
        parts = [state.pop(f"blocks.0.attn.{name}.{kind}") for name in "qkv"]
        state[f"blocks.0.attn.qkv.{kind}"] = torch.cat(parts)
    loaded = GPT(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)
    loaded.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 8))
    assert torch.equal(loaded.logits(ids), saved.logits(ids))
