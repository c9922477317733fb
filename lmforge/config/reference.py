"""The config reference, generated from the schema (README and `lmforge train --help` show it)."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from lmforge.config.schema import RunConfig


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (list, tuple, dict):
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation) if a is not Ellipsis)
        # a tuple of any length is a YAML list (the config keeps lists as tuples: it is frozen)
        name = "list" if origin is tuple and Ellipsis in typing.get_args(annotation) else origin.__name__
        return f"{name}[{args}]"
    if annotation is type(None):
        return "null"
    name = getattr(annotation, "__name__", str(annotation))
    return {"DatasetEntry": "dataset", "Duration": "duration", "ModelConfig": "model shape",
            "TokenizerSpec": "{train|extend: …}", "LoRAConfig": "{rank, alpha, dropout, targets}",
            "TokenizerTrain": "{vocab_size, bos}", "TokenizerExtend": "{vocab_size, base}",
            "RopeScaling": "{type, factor, …}", "MLflowConfig": "mlflow", "WandbConfig": "wandb"}.get(name, name)


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default if field.default_factory is None else field.default_factory()
    if isinstance(value, BaseModel):
        return "on"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(str, value)) + "]" if value else "[]"
    return str(value)


def _section(model: type[BaseModel]) -> type[BaseModel] | None:
    for a in (model,) + typing.get_args(model):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def rows(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every key, sections expanded in place."""
    out = []
    for name, field in model.model_fields.items():
        key = prefix + name
        sub = _section(field.annotation)
        if sub is not None and key != "model":
            plain = isinstance(field.annotation, type)  # a pure section, not "str | section"
            typ = "section" if plain else _type_name(field.annotation)
            out.append((key, typ, "" if plain else _default(field), field.description or ""))
            out += rows(sub, key + ".")
        else:
            out.append((key, _type_name(field.annotation), _default(field), field.description or ""))
    return out


def render_markdown() -> str:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, desc in rows():
        lines.append(f"| `{key}` | {typ.replace('|', '&#124;')} | {default.replace('|', '&#124;')} | {desc} |")
    from lmforge.config.model import ModelConfig

    lines += ["", "`model:` takes a preset name, `{preset: NAME, <overrides>}`, or a full shape with these keys:", "",
              "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, typ, default, desc in rows(ModelConfig):
        lines.append(f"| `{key}` | {typ.replace('|', '&#124;')} | {default} | {desc} |")
    return "\n".join(lines) + "\n"


def render_text() -> str:
    width = max(len(k) for k, *_ in rows())
    lines = ["config keys (defaults from the schema; null/auto = derived from model size and machine):"]
    for key, typ, default, desc in rows():
        if typ == "section" or (not default and typ != "section"):
            lines.append(f"  {key}:")
        else:
            lines.append(f"  {key:<{width}}  {default:<10} {desc}")
    return "\n".join(lines)


def update_readme(path: str = "README.md") -> None:
    """Rewrite the generated block of README.md (``python -m lmforge.config.reference``)."""
    import re

    with open(path) as f:
        text = f.read()
    start, end = "<!-- config-reference:start -->\n", "<!-- config-reference:end -->"
    text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: start + render_markdown() + end, text,
                  flags=re.S)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    update_readme()
