"""Load a run config from YAML (or a dict), apply CLI overrides, report errors in one line."""

from __future__ import annotations

import copy
import difflib
import os
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from lmforge.config.schema import RunConfig
from lmforge.errors import UserError


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML lets the last one win
    silently, which hides the first value from whoever reads the file)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first != key_node.start_mark.line + 1:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {first} and {key_node.start_mark.line + 1}); "
                    "keep one", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str, where: str):
    """YAML text → data, every problem (syntax, a duplicate key) as one UserError naming ``where``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        raise UserError(f"{where}:{at} is not valid YAML ({getattr(e, 'problem', e)})") from None


def read_text_file(path: str, what: str) -> str:
    """A UTF-8 text file's content, or one UserError saying why it cannot be read."""
    if os.path.isdir(path):
        raise UserError(f"{what} {path} is a folder; expected a file")
    if not os.path.exists(path):
        raise UserError(f"{what} not found: {path}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise UserError(f"{what} {path}: cannot read ({e.strerror or e})") from None
    if b"\0" in raw[:8192]:
        raise UserError(f"{what} {path} is a binary file; expected UTF-8 text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{what} {path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}); "
                        "save it as UTF-8") from None


def read_yaml(path: str) -> dict:
    data = load_yaml_text(read_text_file(path, "config file"), path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of config keys at the top level, got {type(data).__name__}")
    return data


def set_path(data: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c = value`` in nested dicts, creating levels as needed."""
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        if not isinstance(node.get(k), dict):
            node[k] = {} if node.get(k) is None or not isinstance(node.get(k), str) else {"preset": node[k]}
        node = node[k]
    node[keys[-1]] = value


def parse_set(item: str) -> tuple[str, Any]:
    """``--set a.b=c``: the value is read as YAML, so numbers, booleans and lists work."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected KEY.PATH=VALUE, e.g. --set parameters.learning_rate=3e-4")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _describe(loc: tuple, model: type[BaseModel]) -> tuple[str, list[str]]:
    """Dotted key for a pydantic error location, and the valid keys at that level."""
    parts: list[str] = []
    cls: Any = model
    valid: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]"] if parts else [f"[{item}]"]
            continue
        if cls is not None and hasattr(cls, "model_fields"):
            valid = list(cls.model_fields)
            field = cls.model_fields.get(item)
            parts.append(str(item))
            cls = _inner_model(field.annotation) if field else None
        else:
            parts.append(str(item))
    return ".".join(parts), valid


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _inner_model(arg)
        if found:
            return found
    return None


def format_error(e: ValidationError, model: type[BaseModel] = RunConfig, source: str | None = None) -> str:
    """The first validation problem as one line naming the key, with a 'did you mean'."""
    errors = e.errors()
    # A misspelt key also shows up as "missing <the right key>": report the misspelling. A value that
    # fails every branch of a union (`tokenizer: PATH | {train: …}`) fails each in its own way: the
    # branch that got furthest into the value says what is wrong with it, not "should be a string".
    same_key = [x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]]
    err = next((x for x in errors if x["type"] == "extra_forbidden"), max(same_key, key=lambda x: len(x["loc"])))
    loc = tuple(x for x in err["loc"] if not (isinstance(x, str) and "[" in x and x not in ("",)))
    # Drop pydantic's union-branch tags such as 'str', 'function-before[...]' or a section's class name
    # (config keys are snake_case).
    loc = tuple(x for x in loc if not (isinstance(x, str) and (x in ("str", "int", "bool", "list", "dict") or "(" in x
                                                               or x[:1].isupper())))
    key, valid = _describe(loc, model)
    prefix = f"{source}: " if source else ""
    if err["type"] == "extra_forbidden":
        name = str(loc[-1])
        close = difflib.get_close_matches(name, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; valid keys here: {', '.join(valid)}"
        return f"{prefix}unknown config key {key!r}{hint}"
    if err["type"] == "missing":
        return f"{prefix}missing required config key {key!r}"
    msg = err["msg"]
    for p in ("Value error, ", "Assertion failed, "):
        msg = msg.replace(p, "")
    given = err.get("input")
    # A message that quotes the value already (a duration's "must be positive, got '0ba'") is not
    # followed by it again.
    shown = "" if isinstance(given, (dict, list)) or repr(given) in msg else f" (got {given!r})"
    if len(shown) > 90:  # a pasted paragraph is named by its start, on the one line
        shown = shown[:80] + "…)"
    if not key:  # a whole-config check: its message names the keys itself
        return f"{prefix}{msg}"
    return f"{prefix}{key}: {msg}{shown}"


def build_config(data: dict, source: str | None = None) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise UserError(format_error(e, RunConfig, source)) from None


def load_raw(
    path: str | None = None,
    data: dict | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> dict:
    """YAML file (or dict) → overrides (``--model`` etc., dotted keys) → ``--set``, not yet validated."""
    raw = read_yaml(path) if path else copy.deepcopy(data or {})
    for key, value in (overrides or {}).items():
        if value is not None:
            set_path(raw, key, value)
    for item in sets or []:
        set_path(raw, *parse_set(item))
    if path and raw.get("name") is None:  # an empty name given on purpose is refused, not replaced
        raw["name"] = os.path.splitext(os.path.basename(path))[0]
    return raw


def load_config(
    path: str | None = None,
    data: dict | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    sets: list[str] | None = None,
) -> RunConfig:
    """YAML file (or dict) → overrides → ``--set`` → validated config."""
    return build_config(load_raw(path, data, overrides=overrides, sets=sets), source=path)
