"""The tree shows where a thing lives (data/, models/), the old paths still work, and imports point one way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_object

from helpers import REPO

PACKAGE = REPO / "dist_trainer"

# What configurations, saved checkpoints (shared.pt's model_config) and scripts named before data/ and
# models/hf.py: each old dotted path must be the very object the new one is.
MOVED = {
    "dist_trainer.datasets.char_text": "dist_trainer.data.builtin.char_text",
    "dist_trainer.datasets.digits": "dist_trainer.data.builtin.digits",
    "dist_trainer.datasets.regression": "dist_trainer.data.builtin.regression",
    "dist_trainer.datasets.reference_text_bytes": "dist_trainer.data.builtin.reference_text_bytes",
    "dist_trainer.tokens.token_file": "dist_trainer.data.tokens.token_file",
    "dist_trainer.tokens.TokenFile": "dist_trainer.data.tokens.TokenFile",
    "dist_trainer.prepare.prepare": "dist_trainer.data.prepare.prepare",
    "dist_trainer.prepare.main": "dist_trainer.data.prepare.main",
    "dist_trainer.tokenizer.main": "dist_trainer.data.train_tokenizer.main",
    "dist_trainer.hf.text.hf_text": "dist_trainer.data.hf_text.hf_text",
    "dist_trainer.hf.chat.hf_chat": "dist_trainer.data.hf_chat.hf_chat",
    "dist_trainer.hf.tokenizer.load_tokenizer": "dist_trainer.data.tokenizer.load_tokenizer",
    "dist_trainer.hf.tokenizer.train_bpe": "dist_trainer.data.tokenizer.train_bpe",
    "dist_trainer.hf.models.hf_model": "dist_trainer.models.hf.hf_model",
    "dist_trainer.hf.models.HFModel": "dist_trainer.models.hf.HFModel",
    "dist_trainer.hf.models.TASKS": "dist_trainer.models.hf.TASKS",
    "dist_trainer.data.StepPlan": "dist_trainer.data.loader.StepPlan",
    "dist_trainer.data.TrainLoader": "dist_trainer.data.loader.TrainLoader",
    "dist_trainer.data.build_dataset": "dist_trainer.data.loader.build_dataset",
    "dist_trainer.data.eval_loader": "dist_trainer.data.loader.eval_loader",
    "dist_trainer.data.epoch_batches": "dist_trainer.data.loader.epoch_batches",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_object(old):  # transformers, datasets, tokenizers: imported lazily, not needed
    assert get_object(old) is get_object(MOVED[old])


@pytest.mark.parametrize("module,prog", [("dist_trainer.prepare", "python -m dist_trainer.prepare"),
                                         ("dist_trainer.tokenizer", "python -m dist_trainer.tokenizer")])
def test_the_old_commands_still_run(module, prog):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"usage: {prog}")


def _imports(path: Path):
    """Every dist_trainer module ``path`` imports, at any depth of the file (lazy imports included)."""
    package = list(path.relative_to(REPO).parts[:-1])  # a module's package, or an __init__'s own
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("family", ["data", "models"])
def test_the_data_and_model_families_import_neither_the_run_nor_a_strategy(family):
    above = ("dist_trainer.run", "dist_trainer.trainer", "dist_trainer.parallel", "dist_trainer.final",
             "dist_trainer.plan")
    for path in sorted((PACKAGE / family).glob("*.py")):
        wrong = sorted({m for m in _imports(path) if m.startswith(above)})
        assert not wrong, f"{path.relative_to(REPO)} imports {wrong}"
    if family == "data":  # the model adapter reads its tokenizer from data/; never the other way round
        for path in sorted((PACKAGE / "data").glob("*.py")):
            assert not [m for m in _imports(path) if m.startswith("dist_trainer.models")], path
