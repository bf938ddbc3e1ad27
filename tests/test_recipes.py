"""The recipes of conf/experiment (``+experiment=NAME``): plan mode on each, for its 8 GPUs.

Plan mode builds the dataset and the model's shapes (on the meta device) and
validates the split exactly as training would. The numbers checked here are
computed independently: parameter counts from each architecture's formula (or
the published count), tokens per step, and the model state per rank that
ddp and fsdp imply. The recipe files are the package's (dist_trainer/conf,
which conf/ at the top of the checkout points to); test_launch's venv-install
test reads one from an installed copy.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # five plan-mode processes and a tokenizer: about 40 s (.ci/run runs it)

WORLD = 8


def _plan(args, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "dist_trainer", *args, "plan.only=true",
                             f"plan.world_size={WORLD}", "hydra.run.dir=plan"], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _numbers(out: str) -> dict:
    grab = lambda pattern: int(re.search(pattern, out).group(1).replace(",", ""))  # noqa: E731
    split = re.search(r"micro batch (\d+) x accum steps (\d+) x world (\d+) = global batch (\d+)", out)
    return {"micro": int(split.group(1)), "accum": int(split.group(2)), "global": int(split.group(4)),
            "tokens": grab(r"\(([\d,]+) tokens of data.block_size"), "params": grab(r"model ([\d,]+) trainable"),
            "state": grab(r"model state per rank after an optimizer step: [\d.]+ MiB \((\d+) bytes")}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    with open(root / "train.bin", "wb") as f:  # 100 M uint16 tokens, sparse: no disk used
        f.truncate(200_000_000)
    from dist_trainer.data.builtin import reference_text_bytes

    (root / "text.txt").write_bytes(reference_text_bytes())
    tok = subprocess.run([sys.executable, "-m", "dist_trainer.tokenizer", "--vocab-size", "4000", "--out",
                          str(root / "tok"), str(root / "text.txt")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert tok.returncode == 0, tok.stderr
    text = [f"data.files=[{root / 'text.txt'}]", f"data.tokenizer={root / 'tok'}", f"data.cache_dir={root / 'cache'}"]
    recipes = {"gpt2_small": [f"data.path={root / 'train.bin'}"], "gpt2_small_fsdp": [f"data.path={root / 'train.bin'}"],
               "bert_base_mlm": text, "llama_hf": text}
    # The two hf_text recipes share a cache: the first writes it, so start it alone.
    first = _plan(["+experiment=bert_base_mlm", *text], root)
    first.wait(300)
    procs = {name: _plan([f"+experiment={name}", *args], root) for name, args in recipes.items()}
    outs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}:\n{out[-3000:]}"
        outs[name] = out
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(root / "tok" / "tokenizer.json")).get_vocab_size()
    return {name: _numbers(out) for name, out in outs.items()}, vocab


def test_gpt2_small_recipes(plans):
    numbers, _ = plans
    ddp, fsdp = numbers["gpt2_small"], numbers["gpt2_small_fsdp"]
    V, T, C, L = 50304, 1024, 768, 12
    params = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C  # tied head; 124 M
    for plan in (ddp, fsdp):
        assert plan["params"] == params == 124_475_904
        assert (plan["micro"], plan["accum"], plan["global"]) == (16, 4, 512)
        assert plan["tokens"] == 2**19  # llm.c's 524,288 tokens per step
    # ddp, bf16-master: bf16 weights and grads (LayerNorms in FP32), FP32 masters and their grads,
    # Adam's two moments: 20 bytes a parameter. fsdp: FP32 shard, its grad, two moments, over 8 ranks.
    assert ddp["state"] == pytest.approx(20 * params, rel=1e-4)
    assert fsdp["state"] == pytest.approx(16 * params / WORLD, rel=1e-3)


def test_bert_base_mlm_recipe(plans):
    numbers, vocab = plans
    bert = numbers["bert_base_mlm"]
    # bert-base's published 109,514,298 (BertForMaskedLM, 30522 tokens), less the rows of the
    # embedding and of the head's bias for a smaller vocabulary (the head's weight is tied).
    assert bert["params"] == 109_514_298 - (30522 - vocab) * (768 + 1)
    assert (bert["micro"], bert["accum"], bert["global"], bert["tokens"]) == (32, 1, 256, 256 * 512)


def test_llama_recipe(plans):
    numbers, vocab = plans
    llama = numbers["llama_hf"]
    C, L, kv, ff = 768, 12, 256, 2048  # 4 of 12 heads of 64 for keys and values
    layer = 2 * C * C + 2 * C * kv + 3 * C * ff + 2 * C
    assert llama["params"] == L * layer + C + 2 * vocab * C  # untied embedding and head
    assert (llama["micro"], llama["accum"], llama["global"], llama["tokens"]) == (8, 4, 256, 2**19)
    assert llama["state"] == pytest.approx(16 * llama["params"] / WORLD, rel=2e-3)
