"""Where the test suite's time goes: per test, per file, and start-up against compute.

    python bench/suite_time.py                       # the default tier (the README's test command)
    python bench/suite_time.py -m 'slow or image or slurm' --label slow
    python bench/suite_time.py --from-run DIR --label before   # tables from an earlier run's files
    ... --write docs/benchmarks.md                   # the tables into that file's "Test suite" section

It runs pytest with per-test durations (``--junitxml``) and the suite_profile plugin (tests/suite_profile.py),
which counts the processes each test starts and of which kind. Start-up is estimated per test as its
process starts times what one start of that kind costs on this machine (a launch's ranks start two at a
time, one a core), measured here first: a cold
``python`` importing what a rank imports (torch, Hydra, dist_trainer, transformers, peft, torchao), and a
fork from the preloaded server (tests/preloaded.py). Compute is the rest of the test's time.

The tables: the run's wall time and count, the top 30 tests by time, and every file with its tests,
time, process starts and estimated start-up. With --write they replace the section's table of the
same label (or are added under it), so a before and an after can stand side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTION = "## 23. The test suite's time: `bench/suite_time.py`"
COLD_IMPORTS = "import torch, torch.distributed, hydra, dist_trainer.run, dist_trainer.cli, transformers, peft, torchao"


def measure_start_costs(repeats: int = 3) -> dict:
    """Seconds one process start costs, by kind: a cold interpreter importing a rank's modules, and a fork
    of the preloaded server (the server's own start paid once, reported apart)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cold = []
    for _ in range(repeats):
        begin = time.perf_counter()
        subprocess.run([sys.executable, "-c", COLD_IMPORTS], check=True, env=env, cwd=REPO)
        cold.append(time.perf_counter() - begin)
    probe = ("import sys, time; sys.path.insert(0, 'tests'); import preloaded; preloaded.freeze_env(); "
             "ctx = preloaded.context(); t = time.perf_counter(); p = ctx.Process(target=print, args=('',)); "
             "p.start(); p.join(); server = time.perf_counter() - t; forks = []\n"
             "for _ in range(5):\n"
             "    t = time.perf_counter(); p = ctx.Process(target=print, args=('',)); p.start(); p.join(); "
             "forks.append(time.perf_counter() - t)\n"
             "print(server, sorted(forks)[2])")
    server, fork = (float(x) for x in subprocess.run([sys.executable, "-c", probe], check=True, env=env, cwd=REPO,
                                                     capture_output=True, text=True).stdout.split()[-2:])
    cold_s = sorted(cold)[len(cold) // 2]
    return {"cold": cold_s, "fork": fork, "server": server}


# Which measured cost each counted kind of start pays.
KIND_COST = {"rank_SpawnProcess": "cold", "python": "cold", "torchrun": "cold", "torchrun_rank": "cold",
             "rank_ForkServerProcess": "fork", "rank_ForkProcess": "fork", "rank_Process": "fork", "other": None}


def _wall_starts(kind: str, n: int) -> float:
    """How many starts' worth of wall time ``n`` starts of ``kind`` cost: a launch's ranks (and torchrun's
    workers) import side by side on the 2 cores, two at a time; a lone process or agent costs a whole start."""
    return math.ceil(n / 2) if kind.startswith("rank_") or kind == "torchrun_rank" else n


def run_suite(out_dir: Path, marker: str | None, extra: list) -> float:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DT_SUITE_PROFILE": str(out_dir / "starts.json"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "pytest", "-p", "suite_profile", f"--junitxml={out_dir / 'junit.xml'}", "-q"]
    if marker is not None:
        cmd += ["-m", marker]
    begin = time.perf_counter()
    proc = subprocess.run(cmd + extra, cwd=REPO, env=env)
    wall = time.perf_counter() - begin
    (out_dir / "wall.json").write_text(json.dumps({"wall_s": wall, "returncode": proc.returncode}))
    return wall


def tables(out_dir: Path, costs: dict, label: str) -> str:
    root = ET.parse(out_dir / "junit.xml").getroot()
    starts = {}
    for path in sorted(out_dir.glob("starts.json*")):  # one file, or one a pytest-xdist worker
        starts.update(json.loads(path.read_text()))
    wall = json.loads((out_dir / "wall.json").read_text())["wall_s"]
    tests, outcome = [], defaultdict(int)
    for case in root.iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.test_x[.Class]
        file = f"{parts[1]}.py" if len(parts) > 1 else f"{parts[0]}.py"
        node = "::".join([f"tests/{file}", *parts[2:], case.get("name")])
        kinds = starts.get(node, {})
        startup = sum(_wall_starts(k, n) * costs[KIND_COST[k]] for k, n in kinds.items() if KIND_COST.get(k))
        status = ("failed" if case.find("failure") is not None or case.find("error") is not None
                  else "skipped" if case.find("skipped") is not None else "passed")
        outcome[status] += 1
        tests.append((float(case.get("time", 0.0)), node, file, kinds, startup))
    total = sum(t for t, *_ in tests)
    total_startup = sum(min(s, t) for t, _, _, _, s in tests)
    lines = [f"### {label}", "",
             f"{len(tests)} tests ({', '.join(f'{n} {k}' for k, n in sorted(outcome.items()))}) in "
             f"{wall / 60:.1f} minutes of wall time ({total / 60:.1f} inside the tests). One start costs "
             f"{costs['cold']:.1f} s cold (a new interpreter importing {COLD_IMPORTS[7:]}) and "
             f"{costs['fork'] * 1000:.0f} ms forked from the preloaded server (its own start: "
             f"{costs['server']:.1f} s, once). Start-up, so estimated: {total_startup / 60:.1f} minutes "
             f"({100 * total_startup / max(total, 1e-9):.0f} % of the tests' time).", "",
             "Top 30 tests by time:", "", "| s | start-up s | starts | test |", "|---:|---:|---|---|"]
    for t, node, _, kinds, startup in sorted(tests, reverse=True)[:30]:
        started = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "-"
        lines.append(f"| {t:.1f} | {min(startup, t):.1f} | {started} | `{node}` |")
    lines += ["", "Per file:", "", "| file | tests | s | start-up s | process starts |", "|---|---:|---:|---:|---:|"]
    per_file = defaultdict(lambda: [0, 0.0, 0.0, 0])
    for t, _, file, kinds, startup in tests:
        row = per_file[file]
        row[0] += 1
        row[1] += t
        row[2] += min(startup, t)
        row[3] += sum(kinds.values())
    for file, (n, t, s, k) in sorted(per_file.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {file} | {n} | {t:.1f} | {s:.1f} | {k} |")
    return "\n".join(lines) + "\n"


def write_section(path: Path, label: str, text: str, command: str) -> None:
    doc = path.read_text()
    if SECTION not in doc:
        doc = doc.rstrip("\n") + f"\n\n{SECTION}\n\nMade by `{command}` on this project's 2-core machine.\n\n"
    head, _, rest = doc.partition(SECTION)
    marker = f"### {label}\n"
    if marker in rest:
        before, _, after = rest.partition(marker)
        nxt = after.find("\n### ")
        nxt2 = after.find("\n## ")
        ends = [i for i in (nxt, nxt2) if i >= 0]
        after = after[min(ends) + 1:] if ends else ""
        rest = before + text + ("\n" + after if after else "")
    else:
        nxt = rest.find("\n## ", 1)
        if nxt >= 0:
            rest = rest[:nxt].rstrip("\n") + "\n\n" + text + rest[nxt:]
        else:
            rest = rest.rstrip("\n") + "\n\n" + text
    path.write_text(head + SECTION + rest)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", dest="marker", default=None, help="pytest -m expression (default: pyproject's)")
    parser.add_argument("--label", default="default tier")
    parser.add_argument("--out", type=Path, default=Path("/tmp/dist-trainer-suite-time"))
    parser.add_argument("--from-run", type=Path, help="make the tables from this earlier run's files")
    parser.add_argument("--write", type=Path, help="put the tables into this markdown file's section")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    out_dir = args.from_run or args.out
    costs = measure_start_costs()
    if not args.from_run:
        run_suite(out_dir, args.marker, args.pytest_args)
    text = tables(out_dir, costs, args.label)
    print(text)
    if args.write:
        write_section(args.write, args.label, text, "python bench/suite_time.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
