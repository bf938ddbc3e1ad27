"""docs/config.md is the schema's own documentation: every key documented, the page current, no key left out."""

from __future__ import annotations

import ast
import dataclasses
import sys

from dist_trainer.config import reference
from dist_trainer.config.schema import Config
from helpers import REPO


def _leaves(obj, prefix=""):
    """Every leaf key of a dataclass instance, by dataclasses.fields alone (a dataclass value is a section)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_every_key_of_the_schema_is_documented():
    missing = sorted(k for k, key in reference.keys().items() if not key.doc.strip())
    assert not missing, (f"keys with no documentation in dist_trainer/config/schema.py (a comment after the field, "
                         f"or comment lines right above it): {missing}")


def test_the_walk_covers_every_field_and_the_page_every_key():
    expected = set(_leaves(Config()))
    assert len(expected) > 80 and {"model", "logger", "dist.fsdp.accum_sync", "logging.mlflow.run_name"} <= expected
    generated = reference.keys()
    assert set(generated) == expected, (sorted(expected - set(generated)), sorted(set(generated) - expected))
    text = reference.render()
    absent = sorted(k for k in expected if f"| `{k}` |" not in text)
    assert not absent, absent


def test_docs_config_md_is_current():
    page = REPO / reference.PAGE
    assert page.is_file() and page.read_text(encoding="utf-8") == reference.render(), \
        "docs/config.md is stale: run `python -m dist_trainer.config.reference --write`"


def test_a_row_shows_the_default_as_yaml_and_the_comment_as_one_line():
    rows = {line.split(" | ")[0][3:-1]: line for line in reference.render().splitlines() if line.startswith("| `")}
    assert rows["optim.betas"] == "| `optim.betas` | `[0.9, 0.95]` | AdamW's (muon's too) [beta1, beta2], in [0, 1) |"
    assert rows["optim.muon.exclude"].startswith('| `optim.muon.exclude` | `["*emb*", "*wte*", "*wpe*", ')
    assert "| `precision.fp8.filter` | `null` |" in rows["precision.fp8.filter"]
    assert "| `trainer.ckpt_async` | `false` | Checkpoints but the last are copied" in rows["trainer.ckpt_async"]
    assert rows["optim.eps"].startswith("| `optim.eps` | `1.0e-08` |")
    assert "auto \\| cpu \\| cuda" in rows["trainer.device"]  # a | escaped in the cell
    assert "[configuration.md](configuration.md)" in rows["model"] and "[configuration.md]" in rows["data"]


def test_comments_above_and_after_a_field_are_its_documentation():
    source = ("class A:\n    '''Section\n    text.'''\n\n    # not this one\n\n    # first line,\n    # second\n"
              "    x: int = 1  # and after\n    y: str = 'a # b'  # the string's # is no comment\n    z: int = 0\n")
    assert reference.documentation(source) == (
        {"A": ("Section text.", {"x": "first line, second and after", "y": "the string's # is no comment", "z": ""})})


def test_the_module_imports_the_standard_library_and_the_schema_alone():
    tree = ast.parse((REPO / "dist_trainer" / "config" / "reference.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.level == 1 and not node.module and [a.name for a in node.names] == ["schema"], \
                    ast.dump(node)
            else:
                imported.add(node.module.split(".")[0])
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
