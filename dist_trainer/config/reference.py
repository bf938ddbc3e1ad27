"""The key reference, ``docs/config.md``, generated from the schema's own field documentation.

A key's documentation is the comment on its line in ``schema.py`` (``name: type = default  # what it does``), or
the comment lines right above it; a field whose type is a dataclass is a section (``dist.fsdp``), whose text is
the class docstring and the comment on the field that holds it. The classes and fields are read with ``ast``,
the comments with ``tokenize``, the defaults from the dataclasses themselves (factories called).

    python -m dist_trainer.config.reference            # print the page
    python -m dist_trainer.config.reference --write    # write docs/config.md of this source checkout

Like the rest of the package it imports nothing of dist_trainer but the schema; tests/test_config_reference.py
fails while a key is undocumented or docs/config.md differs from what this prints.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import json
import re
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from . import schema

COMMAND = "python -m dist_trainer.config.reference --write"
PAGE = Path("docs") / "config.md"  # relative to the repository root
GROUPS_PAGE = "configuration.md"  # beside PAGE: the groups (model=, data=, precision=, optim=) and their own keys


class Key(NamedTuple):
    """One leaf key: its dotted name, the schema's default, its documentation."""

    key: str
    default: Any
    doc: str
    free_form: bool  # a Dict node (model, data): its keys are the chosen group's, not the schema's


class Section(NamedTuple):
    """The leaf keys of one dataclass: ``name`` is its dotted path ("" for the root)."""

    name: str
    text: str
    keys: List[Key]


def _comments(source: str) -> Tuple[Dict[int, str], Dict[int, str]]:
    """(comments alone on their line, comments after code), by line number, without the ``#``."""
    alone: Dict[int, str] = {}
    after: Dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, col = token.start
            (after if token.line[:col].strip() else alone)[row] = token.string[1:].strip()
    return alone, after


def documentation(source: str) -> Dict[str, Tuple[str, Dict[str, str]]]:
    """Each top-level class of ``source``: (its docstring, {field: its comments}), whitespace made single spaces.

    A field's comments are the block of comment lines right above it (no blank line between) and the comment
    after it on its own lines, joined into one line."""
    alone, after = _comments(source)
    classes = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {}
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            above, line = [], statement.lineno - 1
            while line in alone:
                above.insert(0, alone[line])
                line -= 1
            trailing = [after[n] for n in range(statement.lineno, statement.end_lineno + 1) if n in after]
            fields[statement.target.id] = " ".join(" ".join(above + trailing).split())
        classes[node.name] = (" ".join((ast.get_docstring(node) or "").split()), fields)
    return classes


def _is_section(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def sections(root: type = schema.Config) -> List[Section]:
    """``root``'s leaf keys, section by section in field order (depth first), with their defaults and docs."""
    docs = documentation(Path(schema.__file__).read_text(encoding="utf-8"))

    def doc(cls: type, name: str) -> str:  # from the class that declares the field
        for klass in cls.__mro__:
            if name in docs.get(klass.__name__, ("", {}))[1]:
                return docs[klass.__name__][1][name]
        return ""

    out: List[Section] = []

    def walk(cls: type, instance: Any, name: str, text: str) -> None:
        hints = typing.get_type_hints(cls)
        keys, nested = [], []
        for f in dataclasses.fields(cls):
            key, value, hint = f"{name}.{f.name}".lstrip("."), getattr(instance, f.name), hints[f.name]
            if _is_section(hint):
                own = docs.get(hint.__name__, ("", {}))[0]
                nested.append((hint, value, key, " ".join(t for t in (own, doc(cls, f.name)) if t)))
            else:
                keys.append(Key(key, value, doc(cls, f.name), typing.get_origin(hint) is dict))
        out.append(Section(name, text, keys))
        for args in nested:
            walk(*args)

    walk(root, root(), "", docs.get(root.__name__, ("", {}))[0])
    return out


def keys(root: type = schema.Config) -> Dict[str, Key]:
    """Every leaf key of ``root``, by its dotted name."""
    return {k.key: k for s in sections(root) for k in s.keys}


_YAML_WORDS = {"null", "~", "true", "false", "yes", "no", "on", "off", "y", "n"}


def yaml_value(value: Any) -> str:
    """``value`` as YAML would show it inline: null, true/false, [a, b], {k: v}; strings quoted only where YAML
    would read them otherwise (a number, a boolean, an alias like ``*emb*``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text  # 1.0e-08: YAML's float
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        plain = re.fullmatch(r"[\w./][\w./+-]*", value) and value.lower() not in _YAML_WORDS
        try:
            float(value)
            plain = False
        except ValueError:
            pass
        return value if plain else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(k)}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


_EDGE_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")  # one that could open or close emphasis


def markdown_text(text: str) -> str:
    """``text`` as Markdown shows it verbatim in a table cell: ``|``, ``*``, ``<``, ``\\`` and the underscores
    that could emphasise (``_target_``, not ``micro_batch``) escaped."""
    text = re.sub(r"[\\*|<]", lambda m: "\\" + m.group(), text)
    return _EDGE_UNDERSCORE.sub(r"\\_", text)


def _code(text: str) -> str:
    """``text`` as inline code in a table cell (a ``|`` escaped, as tables require even in code)."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return fence + pad + text.replace("|", "\\|") + pad + fence


def render(root: type = schema.Config) -> str:
    """The page: a title, how it is made, then each section's table of key, default and meaning."""
    lines = [
        "# Configuration keys",
        "",
        "Every key of the schema (`dist_trainer/config/schema.py`) with its default and its meaning, generated",
        f"from the schema's field comments by `{COMMAND}`: edit the comment beside",
        "the field, not this page. The defaults are the schema's own; `dist_trainer/conf/config.yaml` and the",
        "groups a run composes set some keys over them, and `python -m dist_trainer --cfg job` prints what a run",
        "gets. The groups (`model=`, `data=`, `precision=`, `optim=`) and their own keys are in",
        f"[{GROUPS_PAGE}]({GROUPS_PAGE}).",
    ]
    for section in sections(root):
        lines += ["", f"## `{section.name}`" if section.name else "## Top level"]
        if section.text:
            lines += ["", markdown_text(section.text)]
        if not section.keys:
            continue
        lines += ["", "| key | default | meaning |", "| --- | --- | --- |"]
        for k in section.keys:
            meaning = markdown_text(k.doc)
            if k.free_form:  # no schema below it: the group's keys
                stop = ". " if meaning and not meaning.endswith(".") else " " if meaning else ""
                meaning += f"{stop}Its keys are those of the group chosen: see [{GROUPS_PAGE}]({GROUPS_PAGE})."
            lines.append(f"| {_code(k.key)} | {_code(yaml_value(k.default))} | {meaning} |")
    return "\n".join(lines) + "\n"


def repository_root() -> Optional[Path]:
    """The source checkout this module lies in (docs/ beside the package), or None (an installed copy)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "docs").is_dir() and (root / "pyproject.toml").is_file() else None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dist_trainer.config.reference",
                                     description="Print the configuration key reference (docs/config.md), "
                                                 "generated from dist_trainer/config/schema.py.")
    parser.add_argument("--write", action="store_true",
                        help=f"write {PAGE.as_posix()} of the source checkout instead of printing it")
    args = parser.parse_args(argv)
    text = render()
    if not args.write:
        sys.stdout.write(text)
        return 0
    root = repository_root()
    if root is None:
        parser.error(f"--write needs a source checkout (docs/ and pyproject.toml above {Path(__file__).parent})")
    (root / PAGE).write_bytes(text.encode("utf-8"))
    print(f"wrote {root / PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
