"""data=blend: every global batch holds exactly each source's share, the same samples on any split and resume.

Three real sources (two token files of 40 and 13 samples, a jsonl text source read by hf_text), weights
0.5 / 0.3 / 0.2 (a schedule on the text source where said). The rounding and the order are checked as
arithmetic first (no process); then one 2-rank launch runs the loader and train() for every check that needs
ranks, and one process runs the world-1 side: the same samples in every global batch (their indices compared),
the final weights within SCALE_TOL of the 1-process run, each source's tokens per step exactly its count,
the per-source loss a token-weighted sum over the whole step, and resumes (mid-run, and past the smallest
source's epoch, also of a 2-rank checkpoint in one process) that continue the straight run exactly; a changed
blend on resume is refused naming the key, and goes on with data.blend.allow_change=true.
"""

from __future__ import annotations

import importlib
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_trainer import distributed
from dist_trainer.config import BatchConfig, Config, ConfigError, DistConfig, OptimConfig, PrecisionConfig, \
    TrainerConfig
from dist_trainer.data import BlendPlan, TrainLoader, build_dataset
from dist_trainer.data.mixture import Mixture, apportion, changed_key, plan_lines, taken_table, weight_at, wrap_steps
from dist_trainer.run import build, train
from dist_trainer.validation import validate
from helpers import assert_all_close_scaled
from test_accumulation import in_one_process, launch_clean

BLOCK, GLOBAL, STEPS, VOCAB = 16, 10, 9, 259
WEB, CODE = 40, 13  # samples of each token file
SCHEDULE = [[1, 0.2], [6, 0.5]]  # the text source's weight: 0.2 at step 1, 0.5 from step 6


# --------------------------------------------------------------------------- sources and configs

@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    for name, samples in (("web", WEB), ("code", CODE)):
        rng.integers(0, 256, size=samples * BLOCK + 1).astype(np.uint16).tofile(root / f"{name}.bin")
    with open(root / "notes.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"note {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)})
                    + "\n")
    build_dataset(blend_config(root, 10).data)  # the text source's cache, once: every run here reuses it
    return root


def blend_config(root: Path, micro: int, steps: int = STEPS, notes_weight=0.2, **data) -> Config:
    # held out: web's val_path (code's file will do) and a quarter of the notes; code has none
    sources = {"web": {"kind": "tokens", "path": str(root / "web.bin"), "weight": 0.5,
                       "val_path": str(root / "code.bin")},
               "code": {"kind": "tokens", "path": str(root / "code.bin"), "weight": 0.3},
               "notes": {"kind": "hf_text", "files": [str(root / "notes.jsonl")], "weight": notes_weight,
                         "cache_dir": str(root / "cache"), "val_fraction": 0.25}}
    return Config(
        model={"_target_": "dist_trainer.models.GPT", "vocab_size": VOCAB, "block_size": BLOCK, "n_layer": 1,
               "n_head": 2, "n_embd": 16, "dropout": 0.0,
               "bias": False},  # a key bias has no gradient but rounding, which AdamW blows up to its lr
        data={"_target_": "dist_trainer.data.blend.blend", "sources": sources, "block_size": BLOCK,
              "tokenizer": "bytes", "vocab_size": VOCAB, "seed": 0, "split": "train", "blend": {"allow_change": False},
              **data},
        batch=BatchConfig(micro_batch_size=micro, global_batch_size=GLOBAL),
        precision=PrecisionConfig(name="fp32"),
        optim=OptimConfig(name="adamw", lr=3e-3, warmup_steps=0, schedule="constant", grad_clip=None),
        trainer=TrainerConfig(max_steps=steps, log_every=100, eval_every=0, ckpt_every=0, device="cpu",
                              tune_malloc=False),
        dist=DistConfig(),
    )


# --------------------------------------------------------------------------- the arithmetic

def test_constant_weights_give_exact_counts_every_step():
    mixture = Mixture(["web", "code", "notes"], [[(1, 0.5)], [(1, 0.3)], [(1, 0.2)]], 10)
    assert all(mixture.counts(s) == [5, 3, 2] for s in range(1, 201))
    # 8 samples: 4 / 2.4 / 1.6 a step, the remainders carried: every prefix within one sample of the weights
    mixture = Mixture(["web", "code", "notes"], [[(1, 0.5)], [(1, 0.3)], [(1, 0.2)]], 8)
    counts = np.array([mixture.counts(s) for s in range(1, 201)])
    assert (counts.sum(axis=1) == 8).all() and set(counts[:, 1]) == {2, 3}
    ideal = np.cumsum(np.tile([4.0, 2.4, 1.6], (200, 1)), axis=0)
    assert np.abs(np.cumsum(counts, axis=0) - ideal).max() < 1
    assert mixture.taken(200) == [800, 480, 320]


def test_random_schedules_stay_within_one_sample():
    """Weights 0 or >= 1/G, schedules included: each source's count over steps 1..s within 1 of its weights'."""
    rng = random.Random(0)
    for _ in range(60):
        n, total = rng.randint(2, 5), rng.choice([1, 3, 8, 10, 32])
        points = [sorted(rng.sample(range(1, 120), 3)) for _ in range(n)]
        schedules = [[(s, rng.choice([0.0, 1.0 / total, rng.uniform(1.0 / total, 1.0)])) for s in p] for p in points]
        schedules[0] = [(1, 1.0)]  # some weight at every step
        mixture = Mixture([str(k) for k in range(n)], schedules, total)
        ideal = np.zeros(n)
        for s in range(1, 150):
            w = np.array(mixture.weights(s))
            if ((w > 0) & (w < 1.0 / total - 1e-12)).any():  # normalising can take a weight below 1/G
                break
            ideal += total * w
            counts = mixture.counts(s)
            assert sum(counts) == total and min(counts) >= 0
            assert np.abs(np.array(mixture.taken(s)) - ideal).max() < 1, (schedules, s)


def test_a_schedule_is_interpolated_and_followed():
    points = [(1, 0.2), (6, 0.5)]
    assert [weight_at(points, s) for s in (1, 2, 6, 10)] == pytest.approx([0.2, 0.26, 0.5, 0.5])
    mixture = Mixture(["a", "b"], [[(1, 0.8), (6, 0.5)], [(1, 0.2), (6, 0.5)]], 10)
    assert mixture.counts(1) == [8, 2] and mixture.counts(6) == [5, 5] and mixture.counts(30) == [5, 5]
    b = [mixture.counts(s)[1] for s in range(1, 7)]
    assert b == sorted(b) and sum(mixture.taken(6)) == 60  # rises with its weight, every step full
    counts, carry = apportion(10, [0.26, 0.74], [0.0, 0.0])
    assert counts == [3, 7] and carry == pytest.approx([-0.4, 0.4])


def test_any_split_takes_the_same_samples_and_each_source_wraps_on_its_own(files):
    cfg = blend_config(files, 10, steps=30)
    one = BlendPlan.for_config(build_dataset(cfg.data), cfg, validate(cfg, 1), 0)
    steps = [one.step_samples(s) for s in range(1, 31)]
    for world, micro in ((2, 1), (2, 5), (5, 1), (10, 1)):
        plan = validate(blend_config(files, micro, steps=30), world)
        ranks = [BlendPlan(one.blend, one.mixture, plan, r, 0, True, False) for r in range(world)]
        for s, windows in enumerate(zip(*(r.windows(0, 0) for r in ranks))):
            got = sorted(i for w in windows for mb in w for i in mb)
            assert got == sorted(steps[s].tolist()), (world, micro, s)
            assert all(len(mb) == micro for w in windows for mb in w)
        assert s == 29  # every step of the run compared
    # a resume at step 17 continues with the very samples of step 18 on
    later = BlendPlan.for_config(one.blend, cfg, validate(cfg, 1), 0)
    assert [w[0] for w in later.windows(0, 17)] == [s.tolist() for s in steps[17:]]
    # each source takes the next samples of its own stream: epoch after epoch, each a new permutation of it
    offsets, lengths = one.blend.offsets, one.blend.lengths
    for k, name in enumerate(one.blend.names):
        stream = np.concatenate([one.source_epoch(k, e)(np.arange(lengths[k])) for e in range(8)])
        assert sorted(stream[:lengths[k]].tolist()) == list(range(lengths[k]))
        assert not np.array_equal(stream[:lengths[k]], stream[lengths[k]:2 * lengths[k]])
        for s in range(1, 31):
            got = [i - offsets[k] for i in steps[s - 1].tolist() if offsets[k] <= i < offsets[k + 1]]
            before, after = one.mixture.taken(s - 1)[k], one.mixture.taken(s)[k]
            assert sorted(got) == sorted(stream[before:after].tolist()), (name, s)
    # code (13 samples, 3 a step) wraps at steps 5, 9, 14, ...: plan mode says so
    assert wrap_steps(taken_table(one.mixture, 20)[:, 1], CODE) == [5, 9, 14, 18]
    lines = "\n".join(plan_lines(one.mixture, lengths, one.blend.kinds, 20))
    assert "code (tokens, 13 samples): weight 0.3, 3 samples a step" in lines and "wraps at steps 5, 9, 14, 18" in lines


def test_a_resume_names_what_changed_in_the_blend():
    saved = {"web": {"kind": "tokens", "weight": [[1, 0.5]], "length": 40},
             "code": {"kind": "tokens", "weight": [[1, 0.3]], "length": 13}}
    assert changed_key(saved, json.loads(json.dumps(saved))) is None
    cases = [({"web": saved["web"]}, "data.sources.code", "not in this run's"),
             ({**saved, "math": saved["code"]}, "data.sources.math", "is new"),
             ({**saved, "code": {**saved["code"], "kind": "hf_text"}}, "data.sources.code.kind", "was tokens"),
             ({**saved, "web": {**saved["web"], "weight": [[1, 0.5], [90, 0.1]]}}, "data.sources.web.weight",
              "was [[1, 0.5]] in the checkpoint, now [[1, 0.5], [90, 0.1]]"),
             ({**saved, "code": {**saved["code"], "length": 14}}, "data.sources.code", "13 samples")]
    for now, key, why in cases:
        got = changed_key(saved, now)
        assert got[0] == key and why in got[1], (key, got)


def test_the_models_per_row_sums_add_up_to_their_loss():
    """The per-source loss reads each row's sums: the built-in GPT's and a Hugging Face model's token loss."""
    from dist_trainer.models import GPT
    from dist_trainer.models.hf import token_loss

    torch.manual_seed(0)
    logits, targets = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    targets[0, :4], targets[2] = -100, -100  # a row with no counted target at all
    for per_row, whole in ((GPT.sample_loss_terms(logits, targets), GPT.loss_terms(logits, targets)),
                           (token_loss(logits, targets, per_sample=True), token_loss(logits, targets))):
        assert per_row["sample_items"].tolist() == [3, 7, 0] and int(per_row["num_items"]) == 10
        assert per_row["sample_loss_sum"][2] == 0
        assert torch.allclose(per_row["loss_sum"], whole["loss_sum"], rtol=1e-6)
        assert torch.allclose(per_row["sample_loss_sum"].sum(), whole["loss_sum"], rtol=1e-6)
        one = torch.nn.functional.cross_entropy(logits[1], targets[1], reduction="sum")
        assert torch.allclose(per_row["sample_loss_sum"][1], one, rtol=1e-6)


def test_streaming_is_a_sources_key(files):
    """data.streaming on the blend itself is refused: each hf_text source says whether it streams
    (tests/test_streaming.py)."""
    cfg = blend_config(files, 10, streaming=True)
    with pytest.raises(ConfigError, match=r"data\.streaming=True: is a source's key in a blend"):
        validate(cfg, 1)


@pytest.mark.parametrize("key,value,message", [
    ("web.weight", -1, "data.sources.web.weight=-1"),
    ("web.weight", [[3, 0.5], [2, 0.1]], "data.sources.web.weight[1]"),
    ("web.kind", "parquet", "data.sources.web.kind='parquet'"),
    ("web.block_size", 32, "data.sources.web.block_size=32: is shared"),
    ("code._target_", "x.y", "data.sources.code._target_='x.y'"),
])
def test_bad_keys_are_named(files, key, value, message):
    cfg = blend_config(files, 10)
    name, field = key.split(".")
    cfg.data["sources"][name][field] = value
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert message in str(err.value)


def test_a_custom_source_is_any_callable(files):
    """kind=custom: _target_ and its own keys; asked for held-out data only if its node has a split key."""
    data = {"_target_": "dist_trainer.data.blend.blend", "block_size": BLOCK, "seed": 0,
            "sources": {"a": {"kind": "custom", "_target_": "dist_trainer.data.builtin.regression", "n": 7,
                              "weight": 0.25},
                        "b": {"kind": "custom", "_target_": "dist_trainer.data.builtin.regression", "n": 5,
                              "seed": 3, "weight": 0.75}}}
    blend = build_dataset(data)
    assert blend.names == ["a", "b"] and blend.lengths == [7, 5] and len(blend) == 12
    sample = blend[8]  # b's sample 1
    assert int(sample["source"]) == 1 and torch.equal(sample["x"], blend.datasets[1][1]["x"])
    assert set(blend.collate([blend[0], blend[8]])) == {"x", "y", "use_branch", "source"}
    assert build_dataset(data, split="val") is None  # neither has a split key: no evaluation


def test_sources_that_disagree_are_refused(files, tmp_path):
    cfg = blend_config(files, 10)
    cfg.data["sources"]["web"]["path"] = str(tmp_path / "missing.bin")
    with pytest.raises(ConfigError, match=r"data\.sources\.web\.path=.*no such file"):
        build_dataset(cfg.data)
    cfg = blend_config(files, 10)
    cfg.data["vocab_size"] = 256  # the text source's documents end with id 256
    with pytest.raises(ConfigError, match=r"data\.sources\.notes\.files=.*token id 256 .* beyond model\.vocab_size=256"):
        build_dataset(cfg.data)
    other = tmp_path / "other"
    other.mkdir()
    (other / "code.bin").write_bytes((files / "code.bin").read_bytes())
    (other / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 50257, "tokenizer": "gpt2.json"}))
    cfg = blend_config(files, 10)
    cfg.data["sources"]["code"]["path"] = str(other / "code.bin")
    with pytest.raises(ConfigError, match=r"data\.sources: the sources' tokenizers differ \(code: gpt2.json, "
                                          r"notes: bytes\)"):
        build_dataset(cfg.data)


def _composed(overrides: list) -> Config:
    """The config the command line composes (Hydra's group files and overrides, as dist_trainer.cli does)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    importlib.import_module("dist_trainer.cli")  # the schema and the resolvers the group files use

    conf = Path(__file__).resolve().parents[1] / "dist_trainer" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=overrides))


def test_the_command_line_composes_a_blend_and_plan_mode_prints_it(files):
    """data=blend with the overrides the docs write (in this process, as the CLI composes them): plan mode's
    lines; a bad weight named."""
    sources = (f"+data.sources={{web:{{kind:tokens,path:{files}/web.bin,weight:0.5}},"
               f"code:{{kind:tokens,path:{files}/code.bin,weight:0.3}},"
               f"notes:{{kind:hf_text,files:[{files}/notes.jsonl],cache_dir:{files}/cache,weight:[[1,0.2],[6,0.5]]}}}}")
    common = ["data=blend", sources, f"data.block_size={BLOCK}", f"model.vocab_size={VOCAB}", "model.n_layer=1",
              "model.n_embd=16", "model.n_head=2", f"batch.global_batch_size={GLOBAL}", "batch.micro_batch_size=5",
              "trainer.max_steps=20"]
    from dist_trainer.plan import plan_report

    report = plan_report(_composed(common), 2)
    assert "blend of 3 sources, 10 samples a step" in report
    assert f"code (tokens, {CODE} samples): weight 0.3, 2-3 samples a step" in report
    assert "notes (hf_text" in report and "weight 0.2@1 -> 0.5@6" in report
    with pytest.raises(ConfigError, match=r"data\.sources\.code\.weight=-0\.3"):
        plan_report(_composed([common[0], sources.replace("weight:0.3", "weight:-0.3"), *common[2:]]), 2)


# --------------------------------------------------------------------------- real ranks

def _windows(env, cfg: Config, world: int, steps: int) -> list:
    """This rank's samples of each step, and each sample's source and first token as its batch holds them."""
    parts = build(cfg, validate(cfg, world), env)
    out = []
    for _, (window, batches) in zip(range(steps), TrainLoader(parts.train_set, parts.step_plan).epoch(0, 0)):
        out.append([(i, int(b["source"][j]), int(b["input_ids"][j, 0])) for ix, b in zip(window, batches)
                    for j, i in enumerate(ix)])
    return out


def _rank(rank: int, world: int, root: str, run_dir: str) -> dict:
    root, run_dir = Path(root), Path(run_dir)
    env = distributed.init("cpu")
    rec = {"windows": _windows(env, blend_config(root, 1, notes_weight=SCHEDULE), world, STEPS)}
    train(blend_config(root, 1, steps=6, notes_weight=SCHEDULE), run_dir / "resumed2")  # 1 process goes on from 6
    return rec


def _one(rank: int, world: int, root: Path, run_dir: Path) -> dict:
    env = distributed.init("cpu")
    rec = {"windows": _windows(env, blend_config(root, 5, notes_weight=SCHEDULE), 1, STEPS)}
    train(blend_config(root, 10, notes_weight=SCHEDULE), run_dir / "straight1")
    for steps in (3, 6, STEPS):  # resumed mid-run (3), then past code's first epoch (it wraps at step 5)
        train(blend_config(root, 10, steps=steps, notes_weight=SCHEDULE), run_dir / "chain1")
    train(blend_config(root, 10, notes_weight=SCHEDULE), run_dir / "resumed2")  # the 2-rank checkpoint, 1 process
    shutil.copytree(run_dir / "chain1", run_dir / "changed")
    try:  # the blend changed: refused, naming the key
        train(blend_config(root, 10, steps=STEPS + 2, notes_weight=1.2), run_dir / "changed")
    except ConfigError as err:
        rec["refused"] = str(err)
    changed = blend_config(root, 10, steps=STEPS + 2, notes_weight=1.2)
    changed.data["blend"]["allow_change"] = True
    train(changed, run_dir / "changed")
    return rec


@pytest.fixture(scope="module")
def runs(files, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    two = launch_clean(_rank, 2, out, str(files), str(out))
    one = in_one_process(_one, files, out)
    return one, two, out


def _metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final(run_dir: Path) -> dict:
    state = torch.load(run_dir / "final_model.pt", weights_only=False)
    return state.get("model", state) if isinstance(state, dict) else state


def test_every_global_batch_holds_the_same_samples_on_one_process_and_two_ranks(runs, files):
    one, two, _ = runs
    cfg = blend_config(files, 10, notes_weight=SCHEDULE)
    expect = BlendPlan.for_config(build_dataset(cfg.data), cfg, validate(cfg, 1), 0)
    for s in range(STEPS):
        ref = sorted(one["windows"][s])
        assert sorted(two[0]["windows"][s] + two[1]["windows"][s]) == ref, s
        assert sorted(i for i, _, _ in ref) == sorted(expect.step_samples(s + 1).tolist())
        per_source = np.bincount([k for _, k, _ in ref], minlength=3).tolist()
        assert per_source == expect.mixture.counts(s + 1)  # the batch's own source column agrees


def test_final_weights_and_per_source_figures_match_one_process(runs, files):
    _, _, out = runs
    # 2 ranks x 5 micro-batches to step 6, its checkpoint resumed by 1 process to step 9: the 1-process weights
    one, two = _final(out / "straight1"), _final(out / "resumed2")
    assert_all_close_scaled(two, one, "2 ranks x 5 micro-batches to step 6, then 1 process")
    m1, m2 = _metrics(out / "straight1"), _metrics(out / "resumed2")
    assert len(m1) == len(m2) == STEPS
    assert m1[-1]["loss"] < m1[0]["loss"] - 0.01  # the weights compared were trained
    mixture = Mixture(["web", "code", "notes"], [[(1, 0.5)], [(1, 0.3)], [(s, w) for s, w in SCHEDULE]], GLOBAL)
    for r1, r2 in zip(m1, m2):
        counts = mixture.counts(r1["step"])
        for k, name in enumerate(("web", "code", "notes")):
            assert r1[f"source_tokens.{name}"] == r2[f"source_tokens.{name}"] == counts[k] * BLOCK
            assert r2[f"source_loss.{name}"] == pytest.approx(r1[f"source_loss.{name}"], rel=1e-5)
        # token-weighted: the sources' losses, weighted by their tokens, are the step's loss
        total = sum(r1[f"source_loss.{n}"] * r1[f"source_tokens.{n}"] for n in ("web", "code", "notes"))
        assert total / r1["items"] == pytest.approx(r1["loss"], rel=1e-6)
        assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
    notes = [r["source_tokens.notes"] // BLOCK for r in m1]  # the schedule: 0.2 at step 1, 0.5 (of 1.3) from 6
    share = [x / (0.8 + x) for x in (0.2 + 0.3 * min(s - 1, 5) / 5 for s in range(1, STEPS + 1))]
    assert notes[0] == 2 and abs(sum(notes) - GLOBAL * sum(share)) < 1 and sum(notes) > 2 * STEPS + 6
    # evaluation at the last step, of each source with held-out data on its own; eval_loss over all their tokens
    held = build_dataset(blend_config(files, 10).data, split="val")
    assert held.names == ["web", "notes"] and "eval_loss.code" not in m1[-1]
    tokens = [min(n, 10 * 10) * BLOCK for n in held.lengths]  # trainer.eval_batches=10 micro-batches of 10 a rank
    losses = [m1[-1]["eval_loss.web"], m1[-1]["eval_loss.notes"]]
    assert m1[-1]["eval_loss"] == pytest.approx(sum(t * x for t, x in zip(tokens, losses)) / sum(tokens), rel=1e-9)
    assert losses[0] != losses[1]
    assert m2[-1]["eval_loss.notes"] == pytest.approx(losses[1], rel=1e-5)
    plan = json.loads((out / "straight1" / "plan.json").read_text())
    assert m1[1]["step_allreduce_bytes"] == plan["step"]["step_allreduce_bytes"]  # the sources' slots, predicted
    assert m1[0]["step_allreduce_bytes"] == plan["first_step"]["step_allreduce_bytes"]


def test_resume_mid_run_and_past_an_epoch_is_bit_identical(runs):
    _, _, out = runs
    straight, chain = _final(out / "straight1"), _final(out / "chain1")
    m_straight = {r["step"]: r for r in _metrics(out / "straight1")}
    m_chain = {r["step"]: r for r in _metrics(out / "chain1")}
    for s in range(1, STEPS + 1):  # steps 4-6 after the resume at 3, 7-9 after the one at 6 (past code's wrap at 5)
        assert m_chain[s]["loss"] == m_straight[s]["loss"], s
        assert all(m_chain[s][k] == m_straight[s][k] for k in m_straight[s] if k.startswith("source_"))
    ckpt = torch.load(out / "chain1" / "checkpoints" / f"step_{STEPS:08d}" / "shared.pt", weights_only=False)
    mixture = Mixture(["web", "code", "notes"], [[(1, 0.5)], [(1, 0.3)], [(s, w) for s, w in SCHEDULE]], GLOBAL)
    assert ckpt["blend"]["taken"] == dict(zip(mixture.names, mixture.taken(STEPS)))
    assert mixture.taken(3)[1] < CODE < mixture.taken(6)[1]  # the resumes: before code's first wrap, and after it
    assert all(torch.equal(chain[name], t) for name, t in straight.items())  # the chain: bit for bit


def test_a_changed_blend_is_refused_unless_allowed(runs):
    one, _, out = runs
    assert one["refused"].startswith("data.sources.notes.weight:") and "data.blend.allow_change=true" in \
        one["refused"]
    m = {r["step"]: r for r in _metrics(out / "changed")}
    assert m[STEPS + 1]["source_tokens.notes"] == m[STEPS + 2]["source_tokens.notes"] == 6 * BLOCK  # 1.2 of 2.0
    ckpt = torch.load(out / "changed" / "checkpoints" / f"step_{STEPS + 2:08d}" / "shared.pt", weights_only=False)
    assert ckpt["blend"]["start"]["step"] == STEPS  # the new rounding starts at the resume, from saved positions
    before = torch.load(out / "chain1" / "checkpoints" / f"step_{STEPS:08d}" / "shared.pt", weights_only=False)
    assert ckpt["blend"]["start"]["taken"] == before["blend"]["taken"]
    assert ckpt["blend"]["taken"]["notes"] == before["blend"]["taken"]["notes"] + 12
    assert sum(ckpt["blend"]["taken"].values()) == sum(before["blend"]["taken"].values()) + 2 * GLOBAL
