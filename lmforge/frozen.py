"""Deep-frozen values: what a resolved run holds cannot be changed in place.

A run is resolved once (`lmforge.resolve`) into a config and a plan that every process reads; a
value that a view or the runtime could change in place (``plan.memory["fits"] = ...``,
``cfg.train_data.append(...)``) would make two readers disagree. `freeze` turns the dicts and lists
inside a value into `FrozenDict` and tuples, recursively: both still read, compare, pickle (a plan
is broadcast from rank 0) and serialize (JSON, YAML after `thaw`) as before, and writing to them
raises TypeError.
"""

from __future__ import annotations

from typing import Any


class FrozenDict(dict):
    """A dict that refuses every change after it is made (a dict subclass: JSON and pickle take it)."""

    def _refuse(self, *_args, **_kwargs):
        raise TypeError("a resolved run is frozen: change the config and resolve it again")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return (FrozenDict, (dict(self),))

    def __hash__(self):  # frozen, so hashable like a tuple of its items
        return hash(tuple(sorted(self.items(), key=repr)))


def freeze(value: Any) -> Any:
    """``value`` with every dict inside it a `FrozenDict` and every list or tuple a tuple."""
    if isinstance(value, dict):
        return value if type(value) is FrozenDict and all(map(_is_frozen, value.values())) else \
            FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def _is_frozen(value: Any) -> bool:
    return not isinstance(value, (dict, list)) or type(value) is FrozenDict


def thaw(value: Any) -> Any:
    """Plain dicts and lists again (for a writer that takes only those, e.g. `yaml.safe_dump`)."""
    if isinstance(value, dict):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value
