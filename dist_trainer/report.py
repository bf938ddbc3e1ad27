"""Plots and a text summary of a run: ``python -m dist_trainer.report RUN_DIR [--out DIR]``.

Reads RUN_DIR/metrics.jsonl and writes loss.png (each source's loss too under data=blend), lr.png,
loss_scale.png, throughput.png, ranks.png (the slowest and fastest rank's data wait and
compute), overview.png (all five) and summary.txt into
RUN_DIR/report/ (or --out). Plotting needs matplotlib (``pip install matplotlib``
or ``pip install 'dist_trainer[report]'``); it is imported only when plotting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

Record = Dict[str, Any]
MISSING_MATPLOTLIB = ("dist_trainer.report: plotting needs matplotlib; install it with "
                      "`pip install matplotlib` (or `pip install 'dist_trainer[report]'`)")


def load_records(path: Path) -> List[Record]:
    """One record per line; a last line cut short by a crash is dropped, a bad line before it is an error."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON record ({err})") from err
    return records


def series(records: Sequence[Record], key: str) -> Tuple[List[int], List[float]]:
    """(steps, values) of the records where key is present and not null."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def summarize(records: Sequence[Record]) -> Record:
    _, losses = series(records, "loss")
    _, evals = series(records, "eval_loss")
    steady = records[len(records) // 2:]  # the second half: past start-up costs
    return {
        "steps": len(records),
        "last_step": records[-1].get("step"),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "min_loss": min(losses) if losses else None,
        "final_eval_loss": evals[-1] if evals else None,
        "skipped_steps": sum(1 for r in records if r.get("skipped")),
        "median_samples_per_s": _median(series(steady, "samples_per_s")[1]),
        "median_step_time_ms": _median([t * 1000 for t in series(steady, "step_time_s")[1]]),
        "peak_mem_mb": max(series(records, "peak_mem_mb")[1], default=None),
        "total_samples": records[-1].get("samples"),
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_summary(s: Record) -> str:
    rows = [
        ("steps", f"{s['steps']} (last step {_fmt(s['last_step'], 'd')})"),
        ("first loss", _fmt(s["first_loss"], ".4f")),
        ("last loss", _fmt(s["last_loss"], ".4f")),
        ("min loss", _fmt(s["min_loss"], ".4f")),
        ("final eval loss", _fmt(s["final_eval_loss"], ".4f")),
        ("skipped steps", str(s["skipped_steps"])),
        ("median samples/s (second half)", _fmt(s["median_samples_per_s"], ".1f")),
        ("median step time ms (second half)", _fmt(s["median_step_time_ms"], ".1f")),
        ("peak memory MB", _fmt(s["peak_mem_mb"], ".1f")),
        ("total samples", _fmt(s["total_samples"], "d")),
    ]
    return "\n".join(f"{name}: {value}" for name, value in rows) + "\n"


def draw_loss(ax, records: Sequence[Record]) -> None:
    ax.plot(*series(records, "loss"), label="train loss")
    sources = dict.fromkeys(k for r in records for k in r if k.startswith("source_loss."))
    for key in sources:  # data=blend: each source's token-weighted loss of the step
        ax.plot(*series(records, key), linewidth=0.8, label=f"{key.removeprefix('source_loss.')} (source)")
    eval_steps, eval_losses = series(records, "eval_loss")
    if eval_steps:
        ax.plot(eval_steps, eval_losses, "o", color="tab:orange", label="eval loss")
    ax.set(title="Loss", xlabel="step", ylabel="loss")
    ax.legend()


def draw_lr(ax, records: Sequence[Record]) -> None:
    ax.plot(*series(records, "lr"), color="tab:green")
    ax.set(title="Learning rate", xlabel="step", ylabel="lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))


def draw_loss_scale(ax, records: Sequence[Record]) -> None:
    steps, scales = series(records, "loss_scale")
    scale_at = dict(zip(steps, scales))
    if steps:
        ax.plot(steps, scales, drawstyle="steps-post", label="loss scale")
        ax.set_yscale("log")
    skipped = [r["step"] for r in records if r.get("skipped")]
    if skipped:  # without a scale the markers sit at 1 on an otherwise empty axis
        ax.plot(skipped, [scale_at.get(s, 1.0) for s in skipped], "x", color="red", markersize=8,
                markeredgewidth=2, label=f"skipped ({len(skipped)})")
    if steps:
        ax.set(title="Loss scale", xlabel="step", ylabel="loss scale")
    else:
        ax.set(title="Loss scale: no dynamic loss scaling", xlabel="step", yticks=[])
        if records[-1]["step"] > records[0]["step"]:  # the whole run, not just the skipped steps
            ax.set_xlim(records[0]["step"], records[-1]["step"])
    if steps or skipped:
        ax.legend()


def draw_throughput(ax, records: Sequence[Record]) -> None:
    lines = ax.plot(*series(records, "samples_per_s"), color="tab:blue", label="samples/s")
    ax.set(title="Throughput", xlabel="step")
    ax.set_ylabel("samples/s", color="tab:blue")
    top = ax
    key = next((k for k in ("tokens_per_s", "items_per_s") if series(records, k)[0]), None)
    if key:
        name = key[:-len("_per_s")] + "/s"
        top = ax.twinx()  # drawn over ax: the legend goes here to stay on top of both lines
        lines += top.plot(*series(records, key), color="tab:purple", linestyle="--", label=name)
        top.set_ylabel(name, color="tab:purple")
    top.legend(lines, [line.get_label() for line in lines], loc="best")


def draw_ranks(ax, records: Sequence[Record]) -> None:
    """The slowest and fastest rank's compute and data wait per step; the rank slowest most often named."""
    drawn = False
    for name, color in (("compute_time", "tab:blue"), ("data_time", "tab:orange")):
        steps, slow = series(records, f"{name}_max_s")
        if not steps:
            continue
        drawn = True
        label = name.replace("_time", "")
        ax.plot(steps, [v * 1000 for v in slow], color=color, label=f"{label}: slowest rank")
        ax.plot(*_ms(series(records, f"{name}_min_s")), color=color, linestyle=":", label=f"{label}: fastest rank")
    if not drawn:
        ax.set(title="Ranks: no per-rank figures in this run", xlabel="step", yticks=[])
        return
    _, busiest = series(records, "data_time_max_rank")
    title = "Slowest and fastest rank"
    if busiest:
        often = max(set(busiest), key=busiest.count)
        title += f" (slowest in data wait most often: rank {often:g}, {busiest.count(often)} of {len(busiest)} steps)"
    ax.set(title=title, xlabel="step", ylabel="ms")
    ax.legend()


def _ms(points: Tuple[List[int], List[float]]) -> Tuple[List[int], List[float]]:
    return points[0], [v * 1000 for v in points[1]]


PANELS: Dict[str, Callable] = {
    "loss": draw_loss, "lr": draw_lr, "loss_scale": draw_loss_scale, "throughput": draw_throughput,
    "ranks": draw_ranks,
}


def _figure_class():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # a bare Figure: no pyplot, no global figure registry

    return Figure


def write_plots(records: Sequence[Record], out: Path, title: str) -> List[Path]:
    Figure = _figure_class()
    paths = []
    for name, draw in PANELS.items():
        fig = Figure(figsize=(7, 4.5), layout="constrained")
        draw(fig.add_subplot(), records)
        paths.append(out / f"{name}.png")
        fig.savefig(paths[-1], dpi=100)
    fig = Figure(figsize=(13, 13), layout="constrained")
    axes = list(fig.subplots(3, 2).flat)
    for ax, draw in zip(axes, PANELS.values()):
        draw(ax, records)
    for ax in axes[len(PANELS):]:
        ax.set_axis_off()
    fig.suptitle(title)
    paths.append(out / "overview.png")
    fig.savefig(paths[-1], dpi=100)
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, help="where to write the report (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"dist_trainer.report: no metrics file {metrics}")
    records = load_records(metrics)
    if not records:
        raise SystemExit(f"dist_trainer.report: {metrics} holds no complete record")
    out = args.out or args.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary = format_summary(summarize(records))
    (out / "summary.txt").write_text(summary)
    print(summary, end="")
    for path in write_plots(records, out, f"Run {args.run_dir.resolve().name}"):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
