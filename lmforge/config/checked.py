"""The base of every config section: unknown keys refused, numbers finite and never booleans.

YAML reads ``true`` as a boolean, and pydantic's lax mode would take it as the number 1
(``learning_rate: true`` trained at an LR of 1); ``.inf`` and ``.nan`` are floats YAML writes
without a word. Both are refused here, once, for every field of every section, naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from lmforge.frozen import freeze


def _parts(annotation: Any) -> list[Any]:
    """The types a union (or ``Annotated``) annotation is made of; the annotation itself otherwise."""
    origin = get_origin(annotation)
    if origin is Union or (origin is not None and type(annotation).__name__ in ("UnionType", "_AnnotatedAlias")):
        return [p for a in get_args(annotation) for p in _parts(a)]
    return [annotation]


def takes_number(annotation: Any) -> bool:
    return any(a in (int, float) for a in _parts(annotation))


def takes_bool(annotation: Any) -> bool:
    """Whether a field of this annotation accepts a boolean as one (``bool``, ``Any``, a union or
    ``Annotated`` holding one); a number field does not."""
    if annotation is bool or annotation is Any:
        return True
    origin = get_origin(annotation)
    if origin is Literal:
        return any(isinstance(v, bool) for v in get_args(annotation))
    if origin is Union or (origin is not None and type(annotation).__name__ in ("UnionType", "_AnnotatedAlias")):
        return any(takes_bool(a) for a in get_args(annotation))
    return False


class Checked(BaseModel):
    # frozen, deeply: a config is a value, never changed in place (a change is a new config, validated)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    @model_validator(mode="after")
    def _frozen_inside(self):
        """Its lists as tuples and its dicts as `FrozenDict`s (`lmforge.frozen`): nothing inside it changes."""
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, (dict, list)):
                object.__setattr__(self, name, freeze(value))
        return self

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v, info: ValidationInfo):
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if isinstance(v, bool) and field is not None and takes_number(field.annotation) \
                and not takes_bool(field.annotation):
            raise ValueError(f"expected a number, not the boolean {str(v).lower()}")
        return v


class Strict(Checked):
    """A section of the run config (the same rules; kept as its own name for the schema's sections)."""

