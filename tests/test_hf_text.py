"""data=hf_text and its tokenizers: ids, file formats, the val split, masking, the cache, ranks agreeing."""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_trainer.config import ConfigError
from dist_trainer.data import hf_text as hf_text_module
from dist_trainer.data.hf_text import _tokenize, build_cache, cache_key, cache_root, hf_text, resolve_files
from dist_trainer.data.prepare import held_out
from dist_trainer.data.tokenizer import BytesTokenizer, TextTokenizer, load_tokenizer
from helpers import run_ranks

EOS = 256  # the bytes tokenizer's end-of-text id


@pytest.fixture(scope="module", autouse=True)
def _offline(tmp_path_factory):
    """Nothing reaches the hub, and no default cache lands in the home directory (spawned ranks inherit it)."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setenv("HF_HOME", str(home / "hf"))
        patch.setenv("DIST_TRAINER_CACHE", str(home / "default_cache"))
        yield


def paragraphs(count: int, start: int = 0) -> list[str]:
    """Real, varied English paragraphs (CPython's pydoc topics), none holding a blank line."""
    from pydoc_data.topics import topics

    docs = [p.strip("\n") for key in sorted(topics) for p in topics[key].split("\n\n")]
    docs = [d for d in docs if d.strip()]
    return docs[start:start + count]


def write(path: Path, docs: list[str]) -> Path:
    """``docs`` as a text (paragraphs), jsonl, parquet or csv file, by the suffix."""
    if path.suffix == ".txt":
        path.write_text("\n\n".join(docs), encoding="utf-8")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path)
    else:
        with open(path, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([("id", "text"), *enumerate(docs)])
    return path


def expected_splits(docs: list[str], val_fraction: float) -> dict[str, np.ndarray]:
    """The bytes tokenizer's stream, each document's UTF-8 then end-of-text, split by document."""
    out = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        out["val" if held_out(i, val_fraction) else "train"] += [*doc.encode("utf-8"), EOS]
    return {k: np.array(v, dtype=np.int64) for k, v in out.items()}


def stream(dataset) -> np.ndarray:
    """Causal LM items back to the tokens they cover: the inputs in order, then the last target."""
    inputs = [dataset[i]["input_ids"] for i in range(len(dataset))]
    return torch.cat([*inputs, dataset[len(dataset) - 1]["targets"][-1:]]).numpy()


# ---------------------------------------------------------------- tokenizers


def test_bytes_tokenizer_maps_utf8_to_its_bytes_and_reloads_with_auto_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = load_tokenizer("bytes")
    assert (tok.vocab_size, tok.eos_id, tok.pad_id, tok.mask_id) == (259, 256, 257, 258)
    (ids,) = tok.encode_batch(["héllo"])
    assert ids.dtype == np.uint32 and ids.tolist() == [104, 195, 169, 108, 108, 111] == list("héllo".encode())
    texts = ["héllo wörld\n\n  tabs\there", "日本語 ✓", paragraphs(1)[0]]
    assert [tok.decode(i) for i in tok.encode_batch(texts)] == texts

    auto = AutoTokenizer.from_pretrained(tok.save(tmp_path / "bytes_tok"))
    assert (auto.eos_token_id, auto.pad_token_id, auto.mask_token_id, len(auto)) == (256, 257, 258, 259)
    assert [auto(t)["input_ids"] for t in texts] == [list(t.encode()) for t in texts]
    again = load_tokenizer(str(tmp_path / "bytes_tok"))
    assert again.to_json() == tok.to_json() and (again.eos_id, again.pad_id, again.mask_id) == (256, 257, 258)


def test_a_long_document_is_cut_only_where_the_ids_stay_those_of_the_whole(tmp_path):
    """466 KB of text as one document: tokenized in pieces, in parallel, with the ids it has whole."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from dist_trainer.data.builtin import reference_text_bytes
    from dist_trainer.data.tokenizer import _cuts, train_bpe

    text = reference_text_bytes().decode()
    cuts = _cuts(text)
    assert len(cuts) >= 10 and all(text[c - 1] == "\n" and not text[c].isspace() for c in cuts)
    train_bpe([paragraphs(300)], 512).save(tmp_path / "bpe")
    tok = load_tokenizer(str(tmp_path / "bpe"))
    whole = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    (ids,) = tok.encode_text([text])
    assert ids.tolist() == whole and tok._cuts_hold  # cut, and every cut held

    # Metaspace marks the text's first word only: cut there, each piece would gain a mark.
    meta = Tokenizer(models.BPE(unk_token="<unk>"))
    meta.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    meta.train_from_iterator(paragraphs(300), trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                                   special_tokens=["<|endoftext|>", "<unk>"]))
    whole = meta.encode(text, add_special_tokens=False).ids
    bounds = [0, *cuts, len(text)]
    naive = [t for a, b in zip(bounds, bounds[1:]) for t in meta.encode(text[a:b], add_special_tokens=False).ids]
    assert naive != whole  # what an unchecked cut would write
    spaced = TextTokenizer(meta, "metaspace")
    (ids,) = spaced.encode_text([text])
    assert ids.tolist() == whole and not spaced._cuts_hold  # the check saw it, and kept the document whole


def test_tokenizer_cli_trains_a_bpe_that_auto_tokenizer_loads_alike(tmp_path, capsys):
    from transformers import AutoTokenizer

    from dist_trainer.data.train_tokenizer import main

    corpus = write(tmp_path / "corpus.txt", paragraphs(300))
    main(["--vocab-size", "512", "--out", str(tmp_path / "bpe"), str(corpus)])
    printed = capsys.readouterr().out
    assert "vocabulary 512" in printed and "tokens per character" in printed

    tok, auto = load_tokenizer(str(tmp_path / "bpe")), AutoTokenizer.from_pretrained(tmp_path / "bpe")
    assert tok.vocab_size == len(auto) == 512
    assert (tok.eos_id, tok.pad_id, tok.mask_id) == (auto.eos_token_id, auto.pad_token_id, auto.mask_token_id) == (0, 1, 2)
    held = paragraphs(20, start=300)  # text it was not trained on
    ids = tok.encode_batch(held)
    assert [i.tolist() for i in ids] == [auto(t)["input_ids"] for t in held]
    assert [tok.decode(i) for i in ids] == held
    ratio = sum(i.size for i in ids) / sum(len(t.encode()) for t in held)
    assert ratio < 0.7  # merges learned: clearly fewer tokens than bytes

    # The trained tokenizer drives hf_text too: its ids, a uint16 file, eos between documents.
    docs = paragraphs(30)
    data = hf_text([str(write(tmp_path / "d.txt", docs))], 8, tokenizer=str(tmp_path / "bpe"), cache_dir=tmp_path / "c")
    want = np.concatenate([np.append(i, tok.eos_id) for i in tok.encode_batch(docs)])
    assert np.array_equal(np.fromfile(data.path, dtype=np.uint16), want)
    assert data.vocab_size == 512 and data.tokenizer.spec == str(tmp_path / "bpe")


@pytest.mark.parametrize("argv, message", [
    ([], "no input FILE"),
    (["missing.txt"], "missing.txt: no such file"),
    (["--vocab-size", "258", "corpus.txt"], "--vocab-size 258: must be at least 259"),
])
def test_tokenizer_cli_bad_input_exits_2_with_an_error(tmp_path, capsys, monkeypatch, argv, message):
    from dist_trainer.data.train_tokenizer import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "corpus.txt", paragraphs(5))
    argv = argv if "--vocab-size" in argv else ["--vocab-size", "300", *argv]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- formats and the val split


@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".parquet", ".csv"])
def test_each_format_gives_the_documents_tokens_with_eos_between_and_val_by_document(tmp_path, suffix):
    docs = paragraphs(48)
    docs[3] = "naïve café, \"quoted\", commas\nand a second line ✓"  # what csv and json must escape
    path = write(tmp_path / f"docs{suffix}", docs)
    want = expected_splits(docs, 0.25)
    train = hf_text([str(path)], 16, val_fraction=0.25, cache_dir=str(tmp_path / "cache"))
    val = hf_text([str(path)], 16, val_fraction=0.25, split="val", cache_dir=str(tmp_path / "cache"))
    for split, data in (("train", train), ("val", val)):
        tokens = want[split]
        assert len(data) == (tokens.size - 1) // 16
        assert np.array_equal(stream(data), tokens[:len(data) * 16 + 1])
        assert np.array_equal(np.fromfile(data.path, dtype=np.uint16), tokens)  # the whole split, nothing cut
        item = data[0]
        assert item["input_ids"].dtype == torch.int64 and torch.equal(item["input_ids"][1:], item["targets"][:-1])
        assert (data.vocab_size, data.block_size, data.items_are_tokens) == (259, 16, True)
    meta = json.loads((train.path.parent / "meta.json").read_text())
    n_val = sum(held_out(i, 0.25) for i in range(len(docs)))
    assert 0 < n_val < len(docs)
    assert (meta["train"]["documents"], meta["val"]["documents"], meta["dtype"]) == (len(docs) - n_val, n_val, "uint16")
    assert hf_text([str(path)], 16, split="val", cache_dir=str(tmp_path / "cache")) is None  # nothing held out


def test_hydra_data_group_builds_through_the_framework(tmp_path):
    from omegaconf import OmegaConf

    from dist_trainer.data import build_dataset

    path = write(tmp_path / "a.txt", paragraphs(20))
    node = OmegaConf.load(Path(hf_text_module.__file__).parents[1] / "conf" / "data" / "hf_text.yaml")
    root = OmegaConf.create({"trainer": {"seed": 3}, "data": node})
    root.data.files, root.data.cache_dir = [str(path)], str(tmp_path / "cache")
    data = OmegaConf.to_container(root, resolve=True)["data"]
    assert (data["task"], data["seed"], data["block_size"]) == ("causal_lm", 3, 128)
    train = build_dataset(data)
    assert len(train) == (expected_splits(paragraphs(20), 0)["train"].size - 1) // 128
    assert build_dataset(data, split="val") is None


# ---------------------------------------------------------------- masked LM


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("masked")
    path = write(tmp / "docs.txt", paragraphs(400))
    return hf_text([str(path)], 128, task="masked_lm", mlm_probability=0.15, seed=7, cache_dir=str(tmp / "cache"))


def test_masking_is_a_function_of_seed_epoch_and_index(masked):
    assert masked.keyed_by_epoch and masked.items_are_tokens and masked.vocab_size == 259
    first = masked[5]
    assert set(first) == {"input_ids", "labels"} and first["input_ids"].shape == (128,)
    assert first["input_ids"].dtype == first["labels"].dtype == torch.int64
    same = [masked[5], masked[(0, 5)], masked[(0, 5 - len(masked))], hf_text_module.MaskedText(
        masked.path, 128, masked.tokenizer, 0.15, 7)[(0, 5)]]
    same.append(pickle.loads(pickle.dumps(masked))[5])  # as a DataLoader worker would get it
    for item in same:  # again, as a tuple, by a negative index, from a new dataset object, in a worker
        assert all(torch.equal(item[k], first[k]) for k in first)
    for other in (masked[(1, 5)], hf_text_module.MaskedText(masked.path, 128, masked.tokenizer, 0.15, 8)[(0, 5)]):
        assert not torch.equal(other["labels"], first["labels"])  # another epoch, another seed: another mask


def test_masking_rates_and_the_80_10_10_split(masked):
    """Each rate within 5 standard deviations of its binomial count (a false alarm about 1 in 10**6)."""
    tokens = np.fromfile(masked.path, dtype=np.uint16).astype(np.int64)
    n = len(masked)
    items = [masked[(e, i)] for e in range(2) for i in range(n)]
    original = np.concatenate([tokens[i * 128:(i + 1) * 128] for _ in range(2) for i in range(n)])
    inputs = torch.cat([it["input_ids"] for it in items]).numpy()
    labels = torch.cat([it["labels"] for it in items]).numpy()
    chosen = labels != -100
    special = np.isin(original, [256, 257, 258])
    assert special.sum() > 200  # end-of-text tokens are there to be left alone...
    assert not chosen[special].any() and np.array_equal(inputs[special], original[special])  # ...and are
    assert np.array_equal(labels[chosen], original[chosen]) and np.array_equal(inputs[~chosen], original[~chosen])

    def within(count: int, total: int, p: float) -> bool:
        return abs(count - p * total) <= 5 * math.sqrt(total * p * (1 - p))

    eligible = int((~special).sum())
    assert within(int(chosen.sum()), eligible, 0.15)
    picked, regular = int(chosen.sum()), 256  # the random token is one of the 256 byte ids
    to_mask = chosen & (inputs == 258)
    to_random = chosen & (inputs != 258) & (inputs != original)
    assert within(int(to_mask.sum()), picked, 0.8)
    assert within(int(to_random.sum()), picked, 0.1 * (1 - 1 / regular))  # a random id may be the original
    assert within(int((chosen & (inputs == original)).sum()), picked, 0.1 + 0.1 / regular)
    assert (inputs[to_random] < 256).all()  # never a special token


# ---------------------------------------------------------------- the cache


def test_the_cache_is_reused_and_keyed_by_the_inputs(tmp_path, monkeypatch, caplog):
    calls = []
    encode = BytesTokenizer.encode_flat
    monkeypatch.setattr(BytesTokenizer, "encode_flat", lambda self, docs: calls.append(len(docs)) or encode(self, docs))
    path = write(tmp_path / "a.txt", paragraphs(40))
    kwargs = {"files": [str(path)], "block_size": 16, "val_fraction": 0.2, "cache_dir": str(tmp_path / "cache")}
    with caplog.at_level(logging.INFO, logger="dist_trainer"):
        first = hf_text(**kwargs)
        stamp = first.path.stat().st_mtime_ns
        assert calls and "wrote the tokenized cache" in caplog.text
        calls.clear(), caplog.clear()
        hf_text(**kwargs), hf_text(**kwargs, split="val"), hf_text(**{**kwargs, "task": "masked_lm", "block_size": 32})
        assert calls == [] and first.path.stat().st_mtime_ns == stamp  # nothing tokenized again
        assert caplog.text.count("reused the tokenized cache") == 2  # the train splits; val says nothing new
    assert len(list((tmp_path / "cache" / "hf_text").iterdir())) == 1

    touched = path.stat().st_mtime_ns + 10**9
    os.utime(path, ns=(touched, touched))  # a touched file: a new key, tokenized again
    assert hf_text(**kwargs).path != first.path and calls
    assert len(list((tmp_path / "cache" / "hf_text").iterdir())) == 2


def test_a_cache_renamed_first_by_another_process_is_kept(tmp_path, monkeypatch):
    """Two nodes on one file system: the second rename loses, and keeps the first one's files."""
    path = write(tmp_path / "a.txt", paragraphs(10))
    tok, sources = load_tokenizer("bytes"), resolve_files([str(path)], None)
    directory = tmp_path / "hf_text" / cache_key(sources, tok, "text", 0.0)
    encode, outcomes = BytesTokenizer.encode_flat, []
    write_tokens = lambda tmp: _tokenize(tmp, sources, tok, "text", 0.0, progress=False)  # noqa: E731

    def racing(self, docs):  # while this build tokenizes, another one finishes
        if not outcomes:
            outcomes.append(None)
            outcomes.append(build_cache(directory, write_tokens))
        return encode(self, docs)

    monkeypatch.setattr(BytesTokenizer, "encode_flat", racing)
    assert build_cache(directory, write_tokens) == "theirs" and outcomes[1] == "written"
    assert sorted(p.name for p in directory.parent.iterdir()) == [directory.name]  # no temporary left
    assert build_cache(directory, write_tokens) == "reused"


def test_default_cache_location(monkeypatch, tmp_path):
    assert cache_root(str(tmp_path / "mine")) == tmp_path / "mine"
    assert cache_root(None) == Path(os.environ["DIST_TRAINER_CACHE"])
    monkeypatch.delenv("DIST_TRAINER_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root(None) == tmp_path / "xdg" / "dist_trainer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root(None) == Path.home() / ".cache" / "dist_trainer"


# ---------------------------------------------------------------- two real ranks


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict:
    """Scenarios run one after the other on both ranks; what each saw comes back to the test."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("dist_trainer")
    logger.addHandler(handler), logger.setLevel(logging.INFO)
    encoded, encode = [], BytesTokenizer.encode_flat  # documents this rank tokenized
    BytesTokenizer.encode_flat = lambda self, docs: encoded.append(len(docs)) or encode(self, docs)
    good, out = os.path.join(tmp, "docs.jsonl"), {}
    os.environ["LOCAL_RANK"] = str(rank)  # one node: as torchrun would set it
    data = hf_text([good], 32, val_fraction=0.2, cache_dir=os.path.join(tmp, "one_node"))
    out["one_node"] = (records[:], [data[i] for i in range(0, len(data), 7)], str(data.path), sum(encoded))
    records.clear(), encoded.clear()
    os.environ["LOCAL_RANK"] = "0"  # two nodes sharing a file system: both build, one rename wins
    data = hf_text([good], 32, cache_dir=os.path.join(tmp, "two_nodes"))
    out["two_nodes"] = (records[:], [data[i] for i in range(0, len(data), 7)], str(data.path), sum(encoded))
    os.environ["LOCAL_RANK"] = str(rank)
    failures = {"text_key": ([good], "body"),  # found only by the rank that reads the file
                "missing_on_rank0": ([os.path.join(tmp, "gone.jsonl") if rank == 0 else good], "text")}
    for name, (files, text_key) in failures.items():
        try:
            hf_text(files, 32, text_key=text_key, cache_dir=os.path.join(tmp, name))
            out[name] = "no error"
        except ConfigError as err:
            out[name] = str(err)
    return out


@pytest.mark.timeout(120)  # a rank left waiting in a collective would hang: fail instead
def test_two_ranks_tokenize_once_agree_on_samples_and_share_errors(tmp_path):
    write(tmp_path / "docs.jsonl", paragraphs(120))
    ranks = run_ranks(_two_ranks, 2, tmp_path, str(tmp_path))

    logs, samples, path, encoded = zip(*(r["one_node"] for r in ranks))
    assert encoded == (120, 0)  # every document tokenized once, by local rank 0 only
    assert [sum("wrote the tokenized cache" in m for m in log) for log in logs] == [1, 0]
    assert path[0] == path[1] and json.loads((Path(path[0]).parent / "meta.json").read_text())["written_by"]["rank"] == 0
    assert all(torch.equal(a[k], b[k]) for a, b in zip(*samples) for k in a)

    logs, samples, path, encoded = zip(*(r["two_nodes"] for r in ranks))
    writers = [sum("wrote the tokenized cache" in m for m in log) for log in logs]
    assert sum(writers) == 1  # exactly one rename won; the other rank reused it or kept it
    assert json.loads((Path(path[0]).parent / "meta.json").read_text())["written_by"]["rank"] == writers.index(1)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(*samples) for k in a)
    assert [p.name for p in Path(path[0]).parents[1].iterdir()] == [Path(path[0]).parent.name]
    assert len(list(Path(path[0]).parents[0].iterdir())) == 3  # train.bin, val.bin, meta.json: no temporaries

    for name, key in (("text_key", "data.text_key='body'"), ("missing_on_rank0", "data.files")):
        assert ranks[0][name] == ranks[1][name] and ranks[0][name].startswith(key), name
    assert "its columns: id, text" in ranks[0]["text_key"] and "gone.jsonl: no such file" in ranks[0]["missing_on_rank0"]


# ---------------------------------------------------------------- bad input


def _tokenizer_file(tmp_path: Path, specials: list[str]) -> str:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tok.json"))
    return str(tmp_path / "tok.json")


BAD = {
    "missing file": ({"files": ["nope.txt"]}, "data.files: nope.txt: no such file"),
    "no files": ({"files": []}, "data.files"),
    "unknown format": ({"format": "xml"}, "data.format='xml'"),
    "unknown extension": ({"files": ["a.xml"]}, "data.format=null"),
    "text_key": ({"files": ["a.jsonl"], "text_key": "body"}, "data.text_key='body'"),
    "tokenizer path": ({"tokenizer": "no/such/dir"}, "data.tokenizer=no/such/dir"),
    "tokenizer unreadable": ({"tokenizer": "a.txt"}, "data.tokenizer=a.txt"),
    "no eos": ({"tokenizer": "WORDLEVEL"}, "data.tokenizer="),
    "no mask for masked_lm": ({"tokenizer": "WORDLEVEL_EOS", "task": "masked_lm"}, "data.tokenizer="),
    "block_size too large": ({"block_size": 10**6}, "data.block_size=1000000"),
    "block_size not an int": ({"block_size": 1.5}, "data.block_size"),
    "val_fraction 1": ({"val_fraction": 1.0}, "data.val_fraction=1.0"),
    "val_fraction negative": ({"val_fraction": -0.1}, "data.val_fraction=-0.1"),
    "task": ({"task": "seq2seq"}, "data.task='seq2seq'"),
    "mlm_probability": ({"task": "masked_lm", "mlm_probability": 0.0}, "data.mlm_probability=0.0"),
    "split": ({"split": "test"}, "data.split='test'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_config_error_naming_the_key(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "a.txt", paragraphs(5))
    write(tmp_path / "a.jsonl", paragraphs(5))
    (tmp_path / "a.xml").write_text("<doc/>")
    kwargs, key = BAD[case]
    kwargs = {"files": ["a.txt"], "block_size": 8, "cache_dir": str(tmp_path / "cache"), **kwargs}
    if kwargs.get("tokenizer", "").startswith("WORDLEVEL"):
        kwargs["tokenizer"] = _tokenizer_file(tmp_path, ["</s>"] if kwargs["tokenizer"].endswith("EOS") else [])
    with pytest.raises(ConfigError) as err:
        hf_text(**kwargs)
    assert str(err.value).startswith(key), str(err.value)
    if case == "text_key":
        assert "its columns: id, text" in str(err.value)
    if case == "no mask for masked_lm":
        assert "mask token" in str(err.value)
