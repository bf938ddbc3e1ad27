"""python -m dist_trainer.report on a real short fp16 run, in subprocesses, plus the edge cases."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_module

REPO = Path(__file__).resolve().parents[1]
PLOTS = ("loss", "lr", "loss_scale", "throughput", "ranks", "overview")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# An init scale of 1e6 overflows fp16 for the first few steps of this tiny GPT (they are
# skipped while the scale halves), after which steps apply: both kinds appear in 8 steps.
TRAIN_ARGS = [
    "trainer.max_steps=8", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "data.block_size=32",
    "batch.global_batch_size=32", "trainer.eval_every=4", "trainer.eval_batches=2",
    "precision=fp16-mixed", "precision.loss_scale.init_scale=1e6",
]


def _run(args: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("tests/test_report.py needs matplotlib: pip install matplotlib (or 'dist_trainer[report]')")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 8-step run and its report: (run dir, report dir, report stdout)."""
    tmp = tmp_path_factory.mktemp("report")
    run_dir = tmp / "run"
    train = run_module([*TRAIN_ARGS, f"hydra.run.dir={run_dir}"], cwd=tmp, timeout=240)  # forked: no start-up
    assert train.returncode == 0, train.stdout + train.stderr
    report = _run(["-m", "dist_trainer.report", str(run_dir)], cwd=tmp, timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    return run_dir, run_dir / "report", report.stdout


def _records(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(report_dir: Path) -> dict:
    rows = (line.split(": ", 1) for line in (report_dir / "summary.txt").read_text().splitlines())
    return {key: value for key, value in rows}


def test_report_writes_valid_pngs(run):
    _, report_dir, _ = run
    for name in PLOTS:
        data = (report_dir / f"{name}.png").read_bytes()
        assert data[:8] == PNG_MAGIC, name
        width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk follows the signature
        assert width >= 600 and height >= 400, (name, width, height)
        assert len(data) > 10_000, (name, len(data))  # axes, lines and text, not a blank canvas
    assert (report_dir / "overview.png").stat().st_size > (report_dir / "lr.png").stat().st_size


def test_summary_matches_metrics(run):
    run_dir, report_dir, stdout = run
    records = _records(run_dir)
    summary = _summary(report_dir)
    assert stdout.startswith((report_dir / "summary.txt").read_text())  # also printed
    skipped = sum(r["skipped"] for r in records)
    assert 0 < skipped < len(records), "the run should have both skipped and applied steps"
    assert summary["skipped steps"] == str(skipped)
    assert summary["steps"] == f"{len(records)} (last step {records[-1]['step']})"
    losses = [r["loss"] for r in records]
    assert summary["first loss"] == f"{losses[0]:.4f}"
    assert summary["last loss"] == f"{losses[-1]:.4f}"
    assert summary["min loss"] == f"{min(losses):.4f}"
    assert summary["final eval loss"] == f"{[r['eval_loss'] for r in records if 'eval_loss' in r][-1]:.4f}"
    assert summary["total samples"] == str(records[-1]["samples"]) == str(8 * 32)
    assert summary["peak memory MB"] == f"{max(r['peak_mem_mb'] for r in records):.1f}"
    steady = sorted(r["samples_per_s"] for r in records[4:])
    assert summary["median samples/s (second half)"] == f"{(steady[1] + steady[2]) / 2:.1f}"


def test_truncated_last_line_and_out_dir(run, tmp_path):
    _require_matplotlib()
    from dist_trainer.report import main

    run_dir, _, _ = run
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copy(run_dir / "metrics.jsonl", crashed / "metrics.jsonl")
    with open(crashed / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "epoch": 0, "lo')  # a crash mid-write
    assert main([str(crashed), "--out", str(tmp_path / "elsewhere")]) == 0
    assert _summary(tmp_path / "elsewhere")["steps"] == "8 (last step 8)"
    assert all((tmp_path / "elsewhere" / f"{name}.png").is_file() for name in PLOTS)
    assert not (crashed / "report").exists()


def test_no_loss_scale_and_missing_keys(tmp_path):
    _require_matplotlib()
    from matplotlib.figure import Figure

    from dist_trainer.report import draw_loss_scale, draw_ranks, draw_throughput, format_summary, summarize, write_plots

    records = [{"step": s, "loss": 2.0 / s, "lr": 1e-3, "loss_scale": None, "skipped": s == 2,
                "samples": 8 * s, "samples_per_s": 100.0 + s, "tokens_per_s": 800.0 + s} for s in range(1, 5)]
    ax = Figure().add_subplot()
    draw_loss_scale(ax, records)
    assert "no dynamic loss scaling" in ax.get_title()
    marks = [line for line in ax.get_lines() if line.get_marker() == "x"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == [2]
    ax = Figure().add_subplot()
    draw_throughput(ax, records)
    legend = [a.get_legend() for a in ax.figure.axes if a.get_legend()][0]
    assert [t.get_text() for t in legend.get_texts()] == ["samples/s", "tokens/s"]
    text = format_summary(summarize(records))  # no eval_loss, step_time_s or peak_mem_mb keys
    assert "final eval loss: -" in text and "peak memory MB: -" in text and "skipped steps: 1" in text
    ax = Figure().add_subplot()
    draw_ranks(ax, records)  # a run from before the per-rank figures
    assert "no per-rank figures" in ax.get_title()
    assert len(write_plots(records, tmp_path, "synthetic")) == len(PLOTS)


def test_the_ranks_panel_draws_the_slowest_and_fastest_rank_and_names_the_usual_straggler():
    _require_matplotlib()
    from matplotlib.figure import Figure

    from dist_trainer.report import draw_ranks

    records = [{"step": s, "data_time_max_s": 0.05, "data_time_max_rank": 1 if s != 3 else 0,
                "data_time_min_s": 0.001, "data_time_min_rank": 0, "compute_time_max_s": 0.02,
                "compute_time_max_rank": 0, "compute_time_min_s": 0.018, "compute_time_min_rank": 1}
               for s in range(1, 5)]
    ax = Figure().add_subplot()
    draw_ranks(ax, records)
    assert [line.get_label() for line in ax.get_lines()] == [
        "compute: slowest rank", "compute: fastest rank", "data: slowest rank", "data: fastest rank"]
    assert list(ax.get_lines()[2].get_ydata()) == [50.0] * 4  # in ms
    assert "rank 1, 3 of 4 steps" in ax.get_title()


def test_missing_matplotlib_says_how_to_install(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "skipped": False}) + "\n")
    code = ("import sys; sys.modules['matplotlib'] = None\n"  # makes `import matplotlib` raise ImportError
            "from dist_trainer.report import main; main([sys.argv[1]])")
    proc = _run(["-c", code, str(tmp_path)], cwd=tmp_path, timeout=60)
    assert proc.returncode != 0
    assert "pip install matplotlib" in proc.stderr, proc.stderr


def test_the_loss_panel_draws_each_source_of_a_blend():
    _require_matplotlib()
    from matplotlib.figure import Figure

    from dist_trainer.report import draw_loss

    records = [{"step": s, "loss": 3.0, "source_loss.web": 2.5, "source_loss.code": 4.0 if s > 1 else None}
               for s in range(1, 4)]
    ax = Figure().add_subplot()
    draw_loss(ax, records)
    assert [line.get_label() for line in ax.get_lines()] == ["train loss", "web (source)", "code (source)"]
    assert list(ax.get_lines()[2].get_xdata()) == [2, 3]  # a step where the source had no tokens is left out
