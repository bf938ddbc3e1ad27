"""The layers' import arrows: config is the ground, validation sits above the features.

``dist_trainer.config`` (the schema and the derived shapes) imports nothing of the project, not even inside a
function, so no feature can reach back into it; ``dist_trainer.validation`` runs each feature's checks from
explicit lists, in a documented order.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dist_trainer"


def _config_files() -> list[Path]:
    """The config layer's source: the package's modules (or a lone config.py)."""
    return sorted((PACKAGE / "config").glob("*.py")) or [PACKAGE / "config.py"]


def _imported(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, at any depth (functions included), relative imports made absolute."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    package = package.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            name = node.module or ""
            if node.level:
                name = f"{base}.{name}" if name else base
            found.append((node.lineno, name))
    return found


def test_config_source_imports_nothing_of_the_project():
    outside = [f"{path.relative_to(REPO)}:{line} imports {name}" for path in _config_files()
               for line, name in _imported(path)
               if (name == "dist_trainer" or name.startswith("dist_trainer."))
               and name != "dist_trainer.config" and not name.startswith("dist_trainer.config.")]
    assert outside == []


def test_importing_config_loads_only_the_config_package():
    code = ("import sys, dist_trainer.config\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('dist_trainer'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}).stdout.split()
    assert "dist_trainer.config" in out
    assert [m for m in out if m != "dist_trainer" and m != "dist_trainer.config"
            and not m.startswith("dist_trainer.config.")] == []


def names(checks: tuple) -> list[str]:
    return [f"{check.__module__.removeprefix('dist_trainer.')}.{check.__name__}" for check in checks]


def test_validation_runs_the_features_checks_in_the_documented_order():
    from dist_trainer import validation

    assert isinstance(validation.KEY_CHECKS, tuple)
    assert names(validation.KEY_CHECKS) == [
        "validation.check_precision", "validation.check_batch", "validation.check_optim", "optim.muon.check_muon",
        "validation.check_optim_state", "validation.check_trainer", "validation.check_dist",
        "parallel.checks.check_tp", "validation.check_loggers", "validation.check_data", "data.mixture.check_blend",
        "data.streaming.check_streaming", "parallel.checks.check_pp",
        "moe.routing.check_moe", "rl.checks.check_task", "rl.checks.check_publish"]
    assert isinstance(validation.MESH_CHECKS, tuple)
    assert names(validation.MESH_CHECKS) == [
        "moe.ep.check_ep_size", "parallel.checks.check_cp", "models.loss.check_loss", "validation.check_fp8",
        "validation.check_optimizer_cuts", "rl.checks.check_task_mesh", "data.mixture.check_blend_mesh"]
    assert names(validation.PLAN_CHECKS) == ["parallel.checks.check_pp_window"]
