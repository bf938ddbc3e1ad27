"""The final model written tensor by tensor (``dist_trainer.final``, ``parallel.state.WholeTensors``,
``models.export``): no rank gathers the whole model to export it.

One launch of 2 ranks trains a tiny GPT and a tiny qwen2 (each with its head tied to the embedding: the
hard case) for 2 steps through ``dist_trainer.run.train`` under fsdp, tp 2 and pp 2, with
safetensors files bounded to 20 KiB (``$DIST_TRAINER_MAX_SHARD_MB``), so every directory holds several
files and an index. Then, for each run:

* final_model.pt, streamed in torch.save's format (``models.torchsave``), loads with
  ``torch.load(weights_only=True)`` and with ``mmap=True``, holds the plain model's state_dict names (a tied
  head under both, one storage), in FP32, equal bit for bit to the trained weights (the last checkpoint,
  read through DCP);
* hf_model/ loads with ``from_pretrained`` and equals them bit for bit, and holds the names transformers'
  own ``save_pretrained`` writes (a tied head once);
* rank 0 held at most one tensor at a time, and said so in the log;
* ``python -m dist_trainer.export`` of the sharded checkpoint writes the same hf_model/ tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import re
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from dist_trainer import checkpoint  # noqa: E402
from dist_trainer.final import SHARD_MB_ENV  # noqa: E402
from dist_trainer.run import train  # noqa: E402
from test_accumulation import launch_clean  # noqa: E402
from test_construct import _fsdp, _pp  # noqa: E402
from test_hsdp import _gpt  # noqa: E402
from test_tp import _qwen2, _tp  # noqa: E402

SHARD_MB = 20 / 1024  # 20 KiB: a tiny model's files are several


def _steps(cfg, steps: int = 2):
    cfg.trainer = dataclasses.replace(cfg.trainer, max_steps=steps)  # the last step writes a checkpoint
    return cfg


JOBS = {"gpt-fsdp": _fsdp(_gpt(8)), "gpt-tp": _tp(_gpt(8)), "gpt-pp": _pp(_gpt(8)),
        "qwen2-fsdp": _fsdp(_qwen2(8)), "qwen2-tp": _tp(_qwen2(8)), "qwen2-pp": _pp(_qwen2(8))}


def _worker(rank: int, world: int, root: str) -> dict:
    said: list = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dist_trainer").addHandler(handler)
    logging.getLogger("dist_trainer").setLevel(logging.INFO)
    out = {}
    os.environ[SHARD_MB_ENV] = str(SHARD_MB)
    for name, cfg in JOBS.items():
        said.clear()
        try:
            train(_steps(cfg), Path(root) / name)
            out[name] = {"said": [m for m in said if "final_model" in m]}
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        gc.collect()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    results = launch_clean(_worker, 2, root, str(root))
    return root, results[0]


def _safetensors_dir(directory: Path) -> dict:
    """Every tensor of a safetensors directory (one file, or several and their index)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(directory / name))
    return tensors


def _final(run_dir: Path, mmap: bool = False) -> dict:
    return torch.load(run_dir / "final_model.pt", weights_only=True, mmap=mmap)


def _plain_keys(cfg) -> set:
    """The state_dict names of the model built whole in one process."""
    from hydra.utils import instantiate

    return set(instantiate(cfg.model, _convert_="all").state_dict())


def _several_files(directory: Path) -> int:
    files = list(directory.glob("model-*-of-*.safetensors"))
    assert (directory / "model.safetensors.index.json").is_file() and len(files) > 1, sorted(directory.iterdir())
    return len(files)


@pytest.mark.parametrize("name", list(JOBS))
def test_the_final_model_is_written_tensor_by_tensor_and_equals_the_trained_weights(runs, name):
    root, results = runs
    assert "error" not in results[name], results[name].get("error")
    run_dir = root / name
    final = _final(run_dir)
    assert set(final) == _plain_keys(JOBS[name])  # a tied head under both of its names
    assert {t.dtype for t in final.values()} == {torch.float32}
    head, embedding = ("head.weight", "tok_emb.weight") if name.startswith("gpt") else \
        ("model.lm_head.weight", "model.model.embed_tokens.weight")
    if head in final:  # a tie is one storage, as torch.save keeps it
        assert final[head].data_ptr() == final[embedding].data_ptr()
    mapped = _final(run_dir, mmap=True)  # the records are aligned as torch.save aligns them
    assert all(torch.equal(mapped[k], v) for k, v in final.items())
    ckpt = checkpoint.list_checkpoints(run_dir / "checkpoints")[0]
    _, trained = checkpoint.read_model(ckpt)  # the trained weights, through DCP's reader
    assert set(trained) <= set(final)
    for key, value in trained.items():
        assert torch.equal(final[key], value), key

    # Rank 0 said what it wrote, and held one tensor at a time.
    said = results[name]["said"]
    line = next(m for m in said if "written tensor by tensor" in m)
    total, largest = (float(x) for x in re.search(r"FP32 model \(([\d.e+-]+) MiB\).*the largest ([\d.e+-]+) MiB",
                                                  line).groups())
    biggest = max(t.numel() * t.element_size() for t in final.values()) / 2**20
    assert largest <= biggest * 1.001 and biggest < total / 2, line  # one tensor, the largest, never the model


@pytest.mark.parametrize("name", [n for n in JOBS if not n.startswith("gpt")])
def test_hf_model_loads_and_equals_the_final_model_with_the_names_transformers_writes(runs, name, tmp_path):
    import transformers

    root, results = runs
    assert "error" not in results[name], results[name].get("error")
    run_dir = root / name
    final = _final(run_dir)
    _several_files(run_dir / "hf_model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_model")
    assert loaded.dtype == torch.float32
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, final[f"model.{key}"]), key

    # The names (and shapes) transformers' own save_pretrained writes for this model: a tied head once.
    from hydra.utils import instantiate

    whole = instantiate(JOBS[name].model, _convert_="all")
    whole.model.save_pretrained(tmp_path / "reference")
    want = {k: v.shape for k, v in _safetensors_dir(tmp_path / "reference").items()}
    got = {k: v.shape for k, v in _safetensors_dir(run_dir / "hf_model").items()}
    assert got == want
    assert "lm_head.weight" not in got  # qwen2's head is its embedding: written once, as transformers does


def test_export_of_a_sharded_checkpoint_reads_it_tensor_by_tensor(runs, tmp_path, monkeypatch):
    """``python -m dist_trainer.export`` of the tied qwen2's fsdp checkpoint: the same hf_model/, each tensor read
    from the checkpoint alone (never the whole model at once)."""
    from dist_trainer.hf import export as hf_export

    root, _ = runs
    reads = []
    model_tensors = checkpoint.model_tensors

    def counted(path):
        shared, shapes, read = model_tensors(path)
        return shared, shapes, lambda name: reads.append(name) or read(name)

    monkeypatch.setattr(checkpoint, "model_tensors", counted)
    hf_export.main([str(root / "qwen2-fsdp"), str(tmp_path / "out"), "--max-shard-mb", str(SHARD_MB)])
    assert len(reads) == len(set(reads))  # each tensor once, then dropped
    got, want = _safetensors_dir(tmp_path / "out"), _safetensors_dir(root / "qwen2-fsdp" / "hf_model")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_streamed_final_model_reads_back_as_torch_save_writes_it(tmp_path):
    """models.torchsave against torch.save itself: the same dict (names, order, dtypes, values), a tie one
    storage, an empty tensor and a bf16 one, read with weights_only and with mmap."""
    from dist_trainer.models.torchsave import TorchSaveWriter

    embedding = torch.randn(261, 16)
    state = {"tok_emb.weight": embedding, "w": torch.randn(3, 5), "steps": torch.tensor([7]),
             "half": torch.randn(4).bfloat16(), "empty": torch.empty(0, 3), "head.weight": embedding}
    writer = TorchSaveWriter(tmp_path / "final_model.pt")
    for key, value in state.items():
        writer.write(key, value, tied_to="tok_emb.weight" if key == "head.weight" else None)
    writer.close()
    torch.save(state, tmp_path / "reference.pt")
    for mmap in (False, True):
        got = torch.load(tmp_path / "final_model.pt", weights_only=True, mmap=mmap)
        want = torch.load(tmp_path / "reference.pt", weights_only=True, mmap=mmap)
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
        assert got["head.weight"].data_ptr() == got["tok_emb.weight"].data_ptr()
