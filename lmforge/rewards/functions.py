"""Reward functions: the built-ins, a user's own, and scoring completions with them.

Every reward has TRL's signature, so a reward written for TRL's ``GRPOTrainer`` works unchanged::

    def my_reward(prompts, completions, **kwargs) -> list[float | None]: ...

``prompts`` and ``completions`` are lists with one entry per completion (a prompt is repeated for
each completion of its group): strings, or — for rows given as ``messages`` — lists of messages
(``[{"role": "assistant", "content": …}]`` for a completion). Every other column of the rows
arrives as a keyword argument holding one value per completion (``None`` where a row lacks it),
and ``completion_ids`` the completions' token ids. ``None`` in the returned list means "not
applicable": the completion is scored by the other rewards alone.

Built-ins (`BUILTINS`): ``exact_match`` (1 when the completion, stripped, equals the row's
``answer``), ``math`` (1 when the completion's final answer equals the row's ``answer`` as numbers:
`answers.same_answer`) and ``format`` (1 when ``rl.format_regex`` is found in the completion).

A reward that raises, returns another number of values than completions, NaN or something that
is not a number, or needs a column a row lacks, is a `RewardError`: one line naming the reward and
the row (``file:line``).
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Sequence

from lmforge.errors import UserError
from lmforge.rewards.answers import boxed, final_answer, same_answer

PROMPT_COLUMNS = ("prompt", "messages")  # what a row's prompt is made of: not passed to rewards as columns
SIGNATURE_ARGS = ("prompts", "completions", "completion_ids")  # what every reward is given besides the columns


class RewardError(UserError):
    """A reward that cannot score: one line naming it and the row."""


def text_of(completion) -> str:
    """A completion's text: itself, or the content of its messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))


def expected_answer(answer) -> str:
    """The answer a row gives: its final answer where it is written out as a solution (``\\boxed{}``,
    ``#### n``: GSM8K's answers), else the whole value."""
    text = str(answer)
    if boxed(text) is not None or "####" in text:
        return final_answer(text) or text.strip()
    return text.strip()


def exact_match(prompts, completions, answer, **_) -> list[float]:
    return [float(text_of(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def math_answer(prompts, completions, answer, **_) -> list[float]:
    return [float(same_answer(final_answer(text_of(c)), expected_answer(a))) for c, a in zip(completions, answer)]


def format_reward(pattern: str) -> Callable:
    regex = re.compile(pattern, re.DOTALL)

    def format(prompts, completions, **_) -> list[float]:  # noqa: A001 - the reward's name
        return [float(regex.search(text_of(c)) is not None) for c in completions]
    return format


BUILTINS = {"exact_match": (exact_match, ("answer",)), "math": (math_answer, ("answer",)), "format": (None, ())}


@dataclass(frozen=True)
class Reward:
    name: str  # as configured: a built-in's name or "path/to/file.py:function"
    fn: Callable
    weight: float = 1.0
    needs: tuple[str, ...] = field(default=())  # columns every row must have
    null_ok: bool = False  # a null value of a needed column is passed on (a user's function), or refused

    @property
    def key(self) -> str:
        """The reward's name in metrics: a built-in's, or the user function's own name."""
        return self.name.rsplit(":", 1)[-1]


def load_rewards(names: Sequence[str], weights: Sequence[float] | None = None,
                 format_regex: str | None = None) -> list[Reward]:
    """The configured rewards (``rl.reward``), user functions imported from their files; one line for a
    file that is missing or cannot be imported, or a function it does not define."""
    weights = list(weights) if weights is not None else [1.0] * len(names)
    out = []
    for name, weight in zip(names, weights):
        if name in BUILTINS:
            fn, needs = BUILTINS[name]
            out.append(Reward(name, fn or format_reward(format_regex or ""), weight, needs))
        else:
            fn = _import(name)
            out.append(Reward(name, fn, weight, _required_columns(fn), null_ok=True))
    keys = [r.key for r in out]
    dup = next((k for k in keys if keys.count(k) > 1), None)
    if dup is not None:
        raise UserError(f"rl.reward: two rewards are named {dup!r} (their metrics would share a name); rename one "
                        "function")
    return out


def _import(name: str) -> Callable:
    path, fn_name = name.rsplit(":", 1)
    if not os.path.isfile(path):
        raise UserError(f"rl.reward: {path}: no such file (expected path/to/file.py:function)")
    module_name = f"lmforge_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # (dataclasses and pickling look modules up by name)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: any error is theirs to see, in one line
        sys.modules.pop(module_name, None)
        raise UserError(f"rl.reward: {path} cannot be imported ({_first_line(e)})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"rl.reward: {path} defines no function {fn_name!r}")
    return fn


def _required_columns(fn: Callable) -> tuple[str, ...]:
    """The keyword arguments a user's reward must be given besides TRL's own (columns of the rows)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.default is p.empty and p.name not in SIGNATURE_ARGS
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_columns(rewards: Sequence[Reward], rows: Sequence[dict], wheres: Sequence[str]) -> None:
    """Every row has the columns each reward needs — a built-in's with a value, a user function's
    keyword arguments at least as null (before any training: one line naming the first row without)."""
    for r in rewards:
        for col in r.needs:
            for row, where in zip(rows, wheres):
                if col not in row or (row[col] is None and not r.null_ok):
                    raise RewardError(f"rl.reward {r.name}: needs column {col!r}, which {where} "
                                      f"{'lacks' if col not in row else 'has as null'}")


def columns(rows: Sequence[dict]) -> dict[str, list]:
    """The rows' columns besides the prompt, one value per row (None where a row lacks one)."""
    names = dict.fromkeys(k for row in rows for k in row if k not in PROMPT_COLUMNS and k not in SIGNATURE_ARGS)
    return {k: [row.get(k) for row in rows] for k in names}


def score(rewards: Sequence[Reward], prompts: list, completions: list, rows: Sequence[dict],
          wheres: Sequence[str], completion_ids: list | None = None) -> list[list[float | None]]:
    """Each reward's values (None: not applicable) for each completion, completion i answering row
    ``rows[i]`` (at ``wheres[i]``)."""
    check_columns(rewards, rows, wheres)
    kwargs = columns(rows) | ({"completion_ids": completion_ids} if completion_ids is not None else {})
    return [_call(r, prompts, completions, kwargs, wheres) for r in rewards]


def _call(r: Reward, prompts: list, completions: list, kwargs: dict, wheres: Sequence[str]) -> list[float | None]:
    n = len(completions)
    try:
        out = r.fn(prompts=prompts, completions=completions, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function: named with the row it fails on
        where = _failing_row(r, prompts, completions, kwargs, wheres)
        raise RewardError(f"rl.reward {r.name} raised {_first_line(e)} on {where}") from None
    try:
        values = list(out)
    except TypeError:
        raise RewardError(f"rl.reward {r.name} returned {type(out).__name__}; expected a list of {n} floats (one per "
                          f"completion, None for not applicable), rows {_span(wheres)}") from None
    except Exception as e:  # noqa: BLE001 - a generator's body runs here, not in the call above
        raise RewardError(f"rl.reward {r.name} raised {_first_line(e)} on the completions of rows "
                          f"{_span(wheres)}") from None
    if len(values) != n:
        raise RewardError(f"rl.reward {r.name} returned {len(values)} values for {n} completions (rows "
                          f"{_span(wheres)}); expected one per completion")
    return [_value(r, v, where) for v, where in zip(values, wheres)]


def _value(r: Reward, v, where: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool):
        v = float(v)
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):  # an int past a float's range: 10**400
        raise RewardError(f"rl.reward {r.name} returned {v!r:.60} ({type(v).__name__}) for the completion of {where}; "
                          "expected a float or None") from None
    if not math.isfinite(x):
        raise RewardError(f"rl.reward {r.name} returned {x} for the completion of {where}; expected a finite float "
                          "(None: not applicable)")
    return x


def _failing_row(r: Reward, prompts, completions, kwargs, wheres) -> str:
    """The completion a reward raises on alone, tried one by one (one that fails only on the whole batch,
    or only once: the batch)."""
    for i, where in enumerate(wheres):
        one = {k: v[i:i + 1] for k, v in kwargs.items()}
        try:
            r.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], **one)
        except Exception:  # noqa: BLE001
            return f"the completion of {where}"
    return f"the completions of rows {_span(wheres)} together (on none of them alone)"


def _span(wheres: Sequence[str]) -> str:
    return wheres[0] if len(set(wheres)) == 1 else f"{wheres[0]} … {wheres[-1]}"


def _first_line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def weighted_total(rewards: Sequence[Reward], values: list[list[float | None]]) -> list[float]:
    """Each completion's reward: the weighted sum of the values that apply (0 where none does)."""
    return [sum(r.weight * v[i] for r, v in zip(rewards, values) if v[i] is not None)
            for i in range(len(values[0]) if values else 0)]
