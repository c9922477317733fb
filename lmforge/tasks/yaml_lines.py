"""YAML loading that remembers line numbers, so a bad task or gauntlet entry is reported as
``file:line N: key ...`` rather than only by its position in a list."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from lmforge.config.load import read_text_file
from lmforge.errors import UserError


class LinedDict(dict):
    """A mapping from a YAML file: ``line`` is where it starts, ``key_lines[k]`` where key k is."""

    line: int | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.key_lines: dict[Any, int] = {}


class _Loader(yaml.SafeLoader):
    pass


def _mapping(loader: _Loader, node: yaml.MappingNode) -> LinedDict:
    loader.flatten_mapping(node)  # resolve `<<:` merge keys the way SafeLoader does
    out = LinedDict()
    out.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in out.key_lines:  # YAML would keep the last silently
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (lines {out.key_lines[key]} and {line}); keep one",
                key_node.start_mark)
        out[key] = loader.construct_object(value_node, deep=True)
        out.key_lines[key] = key_node.start_mark.line + 1
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(path: Path, what: str) -> Any:
    """Parse a YAML file (mappings become LinedDict); UserError when missing or malformed."""
    if not path.exists():
        raise UserError(f"{what} file {path} not found")
    text = read_text_file(str(path), f"{what} file")  # a folder, binary or unreadable file: one line
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f":line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).strip().splitlines()[0]
        raise UserError(f"{path}{at}: not valid YAML ({problem})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file") from None


def line_of(doc: Any, key: Any = None) -> int | None:
    """The line of `key` in `doc` (or of `doc` itself), when `doc` came from a file."""
    if not isinstance(doc, LinedDict):
        return None
    if key is not None and key in doc.key_lines:
        return doc.key_lines[key]
    return doc.line


def at(source: str | None, doc: Any, key: Any = None) -> str:
    """``file:line N`` for a node read from `source`, or just `source` (e.g. an inline config)."""
    line = line_of(doc, key)
    if source is None:
        return ""
    return f"{source}:line {line}" if line is not None else source
