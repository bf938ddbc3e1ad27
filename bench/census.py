"""The test suite's census: every collected test id per CI stage and every tolerance the tests hold.

    python bench/census.py --out census.json                 # collect (about a minute: pytest imports every file)
    python bench/census.py --compare before.json after.json [--renames renames.json]

A stage is what .ci/run runs: ``default`` (the README's test command), ``slow`` (-m 'slow or image or
slurm') and ``sensitive`` (the set .ci/run runs again under another instruction set, read from .ci/run
itself). A tolerance is a number the tests compare against: a module- or function-level constant whose
name says it is a bound (TOL, BOUND, ATOL, RTOL, EPS, MAX_ERR, ...), or a number passed as ``tol=``,
``atol=``, ``rtol=``, ``bound=``, ``abs=`` or ``rel=``; and, so that a bound written inline is seen too,
every float literal between 0 and 1 in each function (as a sorted list). It is keyed by file, enclosing function and
name, never by line, so moving code does not change the census.

--compare prints what a change dropped (a test id gone from a stage, unless --renames maps it to
ids that are there: ``{"old id": ["new id", ...]}``) and every tolerance that moved, loosened or
tightened, and exits 1 when a case was dropped or a bound loosened.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOUND_NAME = re.compile(r"(TOL|BOUND|ATOL|RTOL|EPS|MAX_ERR|MARGIN|SLACK|_ERR$)", re.IGNORECASE)
BOUND_KEYWORDS = {"tol", "atol", "rtol", "bound", "abs", "rel", "tolerance"}


def sensitive_set() -> list:
    """The paths and ids in .ci/run's ``sensitive=(...)`` array."""
    text = (REPO / ".ci" / "run").read_text()
    body = re.search(r"^sensitive=\((.*?)\)", text, re.S | re.M)
    if not body:
        raise SystemExit(".ci/run has no sensitive=(...) array")
    return body.group(1).split()


def collect(*args: str) -> list:
    """pytest --collect-only's test ids for these arguments."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n", "0", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode not in (0, 5):
        raise SystemExit(f"collection failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return sorted(line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" "))


def _number(node: ast.AST):
    """The value of a numeric literal (or -literal, or literal * literal, or 10 ** -n); None otherwise."""
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Pow, ast.Div)):
            left, right = _number(node.left), _number(node.right)
            if left is not None and right is not None:
                try:
                    return {ast.Mult: left * right, ast.Pow: left ** right, ast.Div: left / right}[type(node.op)]
                except (ZeroDivisionError, OverflowError):
                    return None
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def tolerances(root: Path = REPO / "tests") -> dict:
    """"file::function::name" -> the numbers it holds, over every test file (a name used twice in one place
    keeps every value, in order)."""
    found: dict = {}

    def add(key: str, value) -> None:
        found.setdefault(key, []).append(value)

    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        scopes = [(tree, "<module>")]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scopes.append((node, node.name))
            elif isinstance(node, ast.ClassDef):
                scopes += [(item, f"{node.name}.{item.name}") for item in node.body
                           if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope, where in scopes:
            for node in _own_nodes(scope):
                if isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    value = _number(node.value) if node.value is not None else None
                    for target in targets:
                        if isinstance(target, ast.Name) and BOUND_NAME.search(target.id) and value is not None:
                            add(f"{path.name}::{where}::{target.id}", value)
                elif isinstance(node, ast.Constant) and isinstance(node.value, float) and 0 < node.value < 1:
                    add(f"{path.name}::{where}::<literals below 1>", node.value)
                elif isinstance(node, ast.Call):
                    for kw in node.keywords:
                        if kw.arg in BOUND_KEYWORDS and _number(kw.value) is not None:
                            callee = ast.unparse(node.func)
                            add(f"{path.name}::{where}::{callee}({kw.arg}=)", _number(kw.value))
    return {key: sorted(values) if key.endswith("<literals below 1>") else values for key, values in found.items()}


def _own_nodes(scope: ast.AST):
    """Every node inside ``scope`` that is not inside a nested function of a module (functions are scopes
    of their own, and so are a class's methods; a function's nested functions and lambdas stay with it)."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        if isinstance(scope, ast.Module) and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def census() -> dict:
    return {"stages": {"default": collect(), "slow": collect("-m", "slow or image or slurm"),
                       "sensitive": collect(*sensitive_set())},
            "tolerances": tolerances()}


def compare(before: dict, after: dict, renames: dict) -> int:
    bad = 0
    for stage, old_ids in before["stages"].items():
        new_ids = set(after["stages"].get(stage, []))
        everywhere = set().union(*after["stages"].values())
        dropped = []
        for test_id in old_ids:
            if test_id in new_ids:
                continue
            targets = renames.get(test_id) or renames.get(test_id.split("[")[0])
            if targets and all(t in everywhere for t in targets):
                continue
            dropped.append(test_id)
        added = sorted(new_ids - set(old_ids))
        print(f"{stage}: {len(old_ids)} before, {len(new_ids)} after; {len(dropped)} dropped, {len(added)} new")
        for test_id in dropped:
            print(f"  DROPPED {test_id}")
        bad += len(dropped)
    total_before = sum(len(v) for v in before["stages"].values())
    total_after = sum(len(v) for v in after["stages"].values())
    print(f"cases run by CI: {total_before} before, {total_after} after")
    old_t, new_t = before["tolerances"], after["tolerances"]
    moved = 0
    for key in sorted(set(old_t) | set(new_t)):
        a, b = old_t.get(key), new_t.get(key)
        if a == b:
            continue
        moved += 1
        looser = a is not None and b is not None and len(a) == len(b) and any(y > x for x, y in zip(a, b))
        mark = "LOOSENED" if looser else "changed" if a and b else "gone" if b is None else "new"
        print(f"  tolerance {mark}: {key}: {a} -> {b}")
        bad += looser
    print(f"tolerances: {len(old_t)} before, {len(new_t)} after, {moved} differ")
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the census here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--renames", type=Path, help="JSON: old test id -> the ids that now hold its case")
    args = parser.parse_args()
    if args.compare:
        renames = json.loads(args.renames.read_text()) if args.renames else {}
        return compare(*(json.loads(p.read_text()) for p in args.compare), renames)
    result = census()
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
        counts = {stage: len(ids) for stage, ids in result["stages"].items()}
        print(f"{counts}; {len(result['tolerances'])} tolerances -> {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
