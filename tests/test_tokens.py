"""data=tokens and python -m dist_trainer.prepare, with real files on disk.

* prepare: the bytes tokenizer writes every document's bytes then the
  end-of-text id, in order; held-out documents go to val.bin by a hash of
  their index; meta.json records counts and sha256; the files are byte for
  byte those the previous prepare (its own bytes tokenizer, before the one
  loader) wrote; a BPE's files are the library's ids of each document, and
  equal to what data=hf_text writes; a bad input (a jsonl line without the field) and a killed
  prepare leave no directory that looks complete;
* data=tokens: sample i is tokens [i*B, (i+1)*B + 1) of the file, and the
  micro-batches the framework builds for a step are those tokens: the text;
* 2 ranks under torchrun train on a prepared file and the loss falls;
* bad files (a size that is not a whole number of tokens, fewer tokens than
  one sample, ids beyond the vocabulary, a dtype that contradicts meta.json)
  are ConfigErrors naming the key.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dist_trainer.config import ConfigError
from dist_trainer.validation import validate
from dist_trainer.data import StepPlan, epoch_batches
from dist_trainer.data.prepare import BYTES_EOT, PrepareError, held_out, prepare
from dist_trainer.data.tokens import TokenFile, token_file
from helpers import REPO, regression_config, run_module

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet, " * (i % 7 + 1) + "é\n" for i in range(60)]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _expected(docs, keep) -> np.ndarray:
    parts = [np.append(np.frombuffer(d.encode(), dtype=np.uint8).astype(np.uint16), BYTES_EOT)
             for i, d in enumerate(docs) if keep(i)]
    return np.concatenate(parts)


def test_prepare_writes_the_documents_bytes_and_a_complete_meta(corpus, tmp_path):
    out = tmp_path / "tok"
    meta = prepare([corpus], out, "bytes", val_fraction=0.2, progress=False)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert np.array_equal(train, _expected(DOCS, lambda i: not held_out(i, 0.2)))
    assert np.array_equal(val, _expected(DOCS, lambda i: held_out(i, 0.2)))
    assert 0 < meta["val"]["documents"] < 30 and meta["train"]["documents"] + meta["val"]["documents"] == 60
    on_disk = json.loads((out / "meta.json").read_text())
    # 259: the loader's bytes tokenizer also holds <pad> and <mask> (hf_text's); ids here stop at 256.
    assert on_disk["dtype"] == "uint16" and on_disk["vocab_size"] == 259 and on_disk["eot_id"] == BYTES_EOT
    assert on_disk["train"]["tokens"] == train.size and on_disk["val"]["tokens"] == val.size
    import hashlib
    assert on_disk["train"]["sha256"] == hashlib.sha256((out / "train.bin").read_bytes()).hexdigest()
    assert not list(tmp_path.glob(".tok.tmp-*"))
    # What prepare wrote for this corpus before it shared hf_text's tokenizer loader (f4e1da5).
    assert (meta["train"]["sha256"], meta["val"]["sha256"]) == (
        "4ae8392f21dbbb327afd5d46936fdb942737863918770e73358dc8f3213626d8",
        "098af80337b945afabe16a77259f67e19df3dd61583d1260be10c21f32e78756")


def test_prepare_with_a_bpe_writes_the_library_ids_and_what_hf_text_writes(tmp_path):
    from tokenizers import Tokenizer

    from dist_trainer.data.hf_text import hf_text
    from dist_trainer.data.tokenizer import train_bpe

    train_bpe([DOCS], 300).save(tmp_path / "bpe")
    saved = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    saved.enable_truncation(8)  # a classifier's settings: a document is still written whole, unpadded
    saved.enable_padding(length=64, pad_id=1, pad_token="<pad>")
    saved.save(str(tmp_path / "bpe" / "tokenizer.json"))
    # Special tokens' text inside a document is text: not <|endoftext|>'s id, nor <mask>'s.
    docs = [*DOCS, "the end: <|endoftext|> of a <mask> tag"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    meta = prepare([corpus], tmp_path / "tok", str(tmp_path / "bpe"), val_fraction=0.2, progress=False)
    library = Tokenizer.from_file(str(tmp_path / "bpe" / "tokenizer.json"))
    library.no_truncation(), library.no_padding()
    ids = [library.encode(d, add_special_tokens=False).ids for d in docs]
    assert max(map(len, ids)) > 8 and min(map(len, ids)) < 64  # what truncation, padding would change
    assert 0 in ids[-1] and 2 in ids[-1]  # the library's default: the special ids
    library.encode_special_tokens = True
    ids[-1] = library.encode(docs[-1], add_special_tokens=False).ids
    assert 0 not in ids[-1] and 2 not in ids[-1]
    for split, keep in (("train", lambda i: not held_out(i, 0.2)), ("val", lambda i: held_out(i, 0.2))):
        want = [t for i, doc_ids in enumerate(ids) if keep(i) for t in [*doc_ids, 0]]  # <|endoftext|> is 0
        assert np.fromfile(tmp_path / "tok" / f"{split}.bin", dtype=np.uint16).tolist() == want
    assert (meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (library.get_vocab_size(), 0, "uint16")
    # data=hf_text, through the same loader and writer: the same files.
    data = hf_text([str(corpus)], 16, tokenizer=str(tmp_path / "bpe"), val_fraction=0.2,
                   cache_dir=str(tmp_path / "cache"))
    for split in ("train", "val"):
        assert (data.path.parent / f"{split}.bin").read_bytes() == (tmp_path / "tok" / f"{split}.bin").read_bytes()


def test_prepare_bad_input_leaves_nothing(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(corpus.read_text() + json.dumps({"body": "no text field"}) + "\n")
    with pytest.raises(PrepareError, match=r"bad\.jsonl:61: no 'text' field \(set --text-key"):
        prepare([bad], tmp_path / "out", "bytes", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    with pytest.raises(PrepareError, match="--tokenizer=nope: no such file"):
        prepare([corpus], tmp_path / "out", "nope", progress=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(PrepareError, match="--force"):
        prepare([corpus], tmp_path / "out", "bytes", progress=False)


def test_prepare_with_bytes_needs_no_tokenizers_package(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed: importing it raises
    meta = prepare([corpus], tmp_path / "tok", "bytes", progress=False)
    assert np.array_equal(np.fromfile(tmp_path / "tok" / "train.bin", dtype=np.uint16), _expected(DOCS, lambda i: True))
    (tmp_path / "bpe").mkdir()
    (tmp_path / "bpe" / "tokenizer.json").write_text("{}")
    with pytest.raises(PrepareError, match=r"needs? the tokenizers package.*or use --tokenizer bytes"):
        prepare([corpus], tmp_path / "out", str(tmp_path / "bpe"), progress=False)
    assert meta["vocab_size"] == 259


def test_a_killed_prepare_leaves_no_directory_that_looks_complete(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(("a line of text for the tokenizer to chew on\n" * 200) * 2000)  # ~18 MB, one doc per line
    out = tmp_path / "tok"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "dist_trainer.prepare", "--tokenizer", "bytes", "--out", str(out),
                             "--split-lines", "--workers", "1", str(big)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".tok.tmp-*/train.bin")) or not list(tmp_path.glob(".tok.tmp-*/train.bin"))[0].stat().st_size:
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before it could be killed"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists()  # only the temporary directory, named as such, is left


def test_samples_are_the_files_tokens_and_a_step_trains_on_the_text(corpus, tmp_path):
    out = tmp_path / "tok"
    prepare([corpus], out, "bytes", progress=False)
    tokens = np.fromfile(out / "train.bin", dtype=np.uint16).astype(np.int64)
    block = 16
    data = token_file(str(out / "train.bin"), block, vocab_size=257)
    assert len(data) == (tokens.size - 1) // block
    for i in (0, 1, len(data) - 1):
        item = data[i]
        assert torch.equal(item["input_ids"], torch.from_numpy(tokens[i * block:(i + 1) * block]))
        assert torch.equal(item["targets"], torch.from_numpy(tokens[i * block + 1:(i + 1) * block + 1]))
    # The framework's own micro-batches for step 1 of 2 ranks x micro 4 x accum 2, rank 1's view.
    cfg = regression_config(micro=4, glob=16, steps=1)
    plan = validate(cfg, 2)
    step_plan = StepPlan(len(data), plan, rank=1, seed=0, shuffle=True, drop_last=False)
    window, batches = next(epoch_batches(data, step_plan, 0, 0, 0, False))
    text = b"".join(d.encode() + b"\x00" for d in DOCS)  # 256 stands for the separator
    for indices, batch in zip(window, batches):
        for row, index in enumerate(indices):
            ids = batch["input_ids"][row].tolist()
            start = index * block
            assert bytes(t if t < 256 else 0 for t in ids) == text[start:start + block]


def test_two_ranks_train_on_a_prepared_file(corpus, tmp_path):
    out = tmp_path / "tok"
    prepare([corpus] * 8, out, "bytes", val_fraction=0.1, progress=False)
    proc = run_module(["data=tokens", f"data.path={out / 'train.bin'}", f"data.val_path={out / 'val.bin'}",
                       "model.vocab_size=257", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
                       "data.block_size=32", "batch.micro_batch_size=8", "batch.global_batch_size=32",
                       "trainer.max_steps=25", "trainer.eval_every=0", "trainer.eval_batches=2",
                       "optim.lr=3e-3", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, torchrun_nproc=2,
                      agent=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.8 * records[0]["loss"] and "eval_loss" in records[-1]
    assert records[0]["items"] == 32 * 32 and "tokens_per_s" in records[0]


def test_bad_token_files_name_the_key(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=r"data\.path=.*odd\.bin: 3 bytes is not a whole number of uint16"):
        TokenFile(str(odd), 4)
    short = tmp_path / "short.bin"
    np.arange(4, dtype=np.uint16).tofile(short)
    with pytest.raises(ConfigError, match=r"holds 4 tokens, fewer than one sample of data\.block_size=4 \+ 1"):
        TokenFile(str(short), 4)
    big = tmp_path / "big.bin"
    ids = np.zeros(100_000, dtype=np.uint16)
    ids[77_777] = 300
    ids.tofile(big)
    with pytest.raises(ConfigError, match=r"token id 300 at position 77777 is beyond model\.vocab_size=256"):
        TokenFile(str(big), 8, vocab_size=256)
    TokenFile(str(big), 8, vocab_size=301)  # within the vocabulary: fine
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32"}))
    with pytest.raises(ConfigError, match=r"data\.dtype=uint16 but .*meta\.json says uint32"):
        TokenFile(str(big), 8, dtype="uint16")
    with pytest.raises(ConfigError, match=r"data\.val_path=.*nope\.bin: no such file"):
        token_file(str(big), 8, val_path=str(tmp_path / "nope.bin"), split="val")
    assert token_file(str(big), 8, split="val") is None  # no held-out file: no eval loss
