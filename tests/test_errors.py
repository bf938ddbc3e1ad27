"""Errors under torchrun: printed once (by rank 0), and named in torchrun's closing summary."""

from __future__ import annotations

import re

from helpers import run_module


def _summary(output: str) -> str:
    """torchrun's closing summary (what a user reads last)."""
    return output[output.index("Root Cause (first observed failure):"):]


def test_a_config_error_is_printed_once_and_named_in_torchruns_summary(tmp_path):
    proc = run_module(["optim.lr=-1", f"hydra.run.dir={tmp_path}/run"], tmp_path, torchrun_nproc=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert len(re.findall(r"\[ERROR\] - optim\.lr=-1\.0: must be > 0", out)) == 1, out[-3000:]
    summary = _summary(out)
    assert "traceback : ConfigError: optim.lr=-1.0: must be > 0" in summary, summary
    assert "error_file: <N/A>" not in out and "exitcode  : 2" in summary


def test_an_error_hydra_raises_before_our_code_is_printed_once_and_named(tmp_path):
    proc = run_module(["optim.nosuch=1", f"hydra.run.dir={tmp_path}/run"], tmp_path, torchrun_nproc=2)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Hydra's own message, once: the other rank kept it to itself
    assert len(re.findall(r"^Key 'nosuch' not in 'OptimConfig'$", out, flags=re.M)) == 1, out[-3000:]
    assert out.count("Could not override 'optim.nosuch'.\n") == 1
    summary = _summary(out)
    assert "traceback : ConfigError: Could not override 'optim.nosuch'." in summary, summary
    assert "Key 'nosuch' not in 'OptimConfig'" in summary


def test_a_single_process_still_prints_hydras_error(tmp_path):
    proc = run_module(["optim.nosuch=1", f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert proc.returncode == 1
    assert "Could not override 'optim.nosuch'." in proc.stderr
