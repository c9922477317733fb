"""The gauntlet: ICL accuracies grouped into category scores and named averages, as LLM Foundry's
eval gauntlet computes them.

Reads Foundry's ``eval_gauntlet`` YAML (``weighting``, ``subtract_random_baseline``,
``rescale_accuracy``, ``averages``, ``categories`` of ``benchmarks`` with ``name``,
``num_fewshot`` and ``random_baseline``), so its gauntlet files load unchanged. The rules:

- a benchmark's accuracy is the task's accuracy at that shot count; for a task with categories
  (``has_categories``) it is the unweighted mean of the per-category accuracies;
- its score is that accuracy minus the random baseline, divided by ``1 - baseline`` when
  rescaling (so chance is 0 and perfect is 1);
- a category is the weighted mean of its benchmarks: EQUAL, SAMPLE_SZ (the task's full size,
  whatever ``--limit`` scored) or LOG_SAMPLE_SZ (``max(log2(size), 1)``); a category with a
  benchmark missing from the results gets no score;
- an average is the plain mean of the categories it names that have a score. Names of
  categories the file never defines are ignored, as Foundry ignores them (its own default
  gauntlet lists a ``programming`` category that is commented out).

Every benchmark must name a task (label and shot count) that is being evaluated: checked
against the tasks up front, with the file and line of the benchmark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.frozen import thaw
from lmforge.tasks.yaml_lines import at, load_yaml

WEIGHTINGS = ("EQUAL", "SAMPLE_SZ", "LOG_SAMPLE_SZ")
DEFAULT_GAUNTLET = Path(__file__).with_name("gauntlet.yaml")

_TOP_KEYS = {"weighting", "subtract_random_baseline", "rescale_accuracy", "averages", "categories"}
_CATEGORY_KEYS = {"name", "benchmarks", "subtract_random_baseline", "rescale_accuracy"}
_BENCHMARK_KEYS = {"name", "num_fewshot", "random_baseline", "subtract_random_baseline", "rescale_accuracy"}


@dataclass
class Benchmark:
    name: str  # the ICL task label
    num_fewshot: int
    random_baseline: float
    subtract_random_baseline: bool
    rescale_accuracy: bool
    where: str = ""  # "file:line N: categories[i].benchmarks[j]", for error messages

    @property
    def key(self) -> str:
        """The key of this benchmark in `evaluate_icl` results."""
        return f"{self.name}/{self.num_fewshot}-shot"


@dataclass
class Category:
    name: str
    benchmarks: list[Benchmark]


@dataclass
class Gauntlet:
    categories: list[Category]
    weighting: str = "EQUAL"
    averages: dict[str, list[str]] = field(default_factory=dict)
    source: str = ""

    def benchmark_keys(self) -> list[str]:
        return [b.key for c in self.categories for b in c.benchmarks]


def load_gauntlet(path: str | Path, tasks: list | None = None) -> Gauntlet:
    """Load a gauntlet YAML (``"default"`` is the shipped one); UserError naming the file, line
    and field at fault. With `tasks`, every benchmark must be one of them (see check_benchmarks)."""
    path = DEFAULT_GAUNTLET if str(path) == "default" else Path(path).expanduser()
    doc = load_yaml(path, "gauntlet")
    if isinstance(doc, dict) and "eval_gauntlet" in doc:
        doc = doc["eval_gauntlet"]
    gauntlet = parse_gauntlet(doc, str(path), source=str(path))
    if tasks is not None:
        check_benchmarks(gauntlet, tasks)
    return gauntlet


def parse_gauntlet(doc: Any, where: str = "eval.gauntlet", source: str | None = None) -> Gauntlet:
    """Build a Gauntlet from an already-parsed mapping (Foundry's `eval_gauntlet` section)."""
    def loc(node: Any, key: Any = None) -> str:
        return at(source, node, key) or where

    if source is None:  # a resolved run's gauntlet is frozen: read it as the YAML a file gives
        doc = thaw(doc)
    if not isinstance(doc, dict):
        raise UserError(f"{where}: expected a mapping with `categories:` (optionally under `eval_gauntlet:`)")
    _no_unknown(doc, _TOP_KEYS, loc, "")
    weighting = str(doc.get("weighting", "EQUAL")).upper()
    if weighting not in WEIGHTINGS:
        raise UserError(f"{loc(doc, 'weighting')}: weighting {doc.get('weighting')!r} is not one of "
                        f"{', '.join(WEIGHTINGS)}")
    subtract = _flag(doc, "subtract_random_baseline", True, loc, "")
    rescale = _flag(doc, "rescale_accuracy", True, loc, "")
    raw_categories = doc.get("categories")
    if not isinstance(raw_categories, list) or not raw_categories:
        raise UserError(f"{loc(doc, 'categories')}: categories must be a non-empty list")
    categories: list[Category] = []
    for i, raw in enumerate(raw_categories):
        here = f"categories[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{loc(doc, 'categories')}: {here}: expected a mapping with name and benchmarks")
        _no_unknown(raw, _CATEGORY_KEYS, loc, here)
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise UserError(f"{loc(raw)}: {here}: field 'name' is required (a non-empty string)")
        if any(c.name == name for c in categories):
            raise UserError(f"{loc(raw, 'name')}: {here}: duplicate category name {name!r}")
        cat_subtract = _flag(raw, "subtract_random_baseline", subtract, loc, here)
        cat_rescale = _flag(raw, "rescale_accuracy", rescale, loc, here)
        raw_benchmarks = raw.get("benchmarks")
        if not isinstance(raw_benchmarks, list) or not raw_benchmarks:
            raise UserError(f"{loc(raw, 'benchmarks')}: {here} ({name}): benchmarks must be a non-empty list")
        benchmarks = [_benchmark(b, f"{here}.benchmarks[{j}]", loc(raw, "benchmarks"), loc, cat_subtract,
                                 cat_rescale) for j, b in enumerate(raw_benchmarks)]
        categories.append(Category(name, benchmarks))
    names = [c.name for c in categories]
    averages = doc.get("averages")
    if averages is None:
        averages = {"default_average": names}  # Foundry's default: all categories
    if not isinstance(averages, dict):
        raise UserError(f"{loc(doc, 'averages')}: averages must be a mapping of name to a list of category names")
    for avg, members in averages.items():
        if not isinstance(members, list) or not members or not all(isinstance(m, str) for m in members):
            raise UserError(f"{loc(averages, avg)}: averages.{avg} must be a non-empty list of category names")
        if avg in names:
            raise UserError(f"{loc(averages, avg)}: averages.{avg}: an average cannot share a category's name")
    return Gauntlet(categories, weighting, {str(k): list(v) for k, v in averages.items()}, where)


def _benchmark(raw: Any, here: str, parent: str, loc, subtract: bool, rescale: bool) -> Benchmark:
    if not isinstance(raw, dict):
        raise UserError(f"{parent}: {here}: expected a mapping with name, num_fewshot, random_baseline")
    _no_unknown(raw, _BENCHMARK_KEYS, loc, here)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"{loc(raw)}: {here}: field 'name' is required (the ICL task label)")
    shots = raw.get("num_fewshot")
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise UserError(f"{loc(raw, 'num_fewshot')}: {here} ({name}): num_fewshot must be a non-negative integer, "
                        f"got {shots!r}")
    baseline = raw.get("random_baseline", 0.0)
    if not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or not 0 <= baseline < 1:
        raise UserError(f"{loc(raw, 'random_baseline')}: {here} ({name}): random_baseline must be a number in "
                        f"[0, 1), got {baseline!r}")
    return Benchmark(name, shots, float(baseline), _flag(raw, "subtract_random_baseline", subtract, loc, here),
                     _flag(raw, "rescale_accuracy", rescale, loc, here), f"{loc(raw, 'name')}: {here}")


def _flag(doc: dict, key: str, default: bool, loc, here: str) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise UserError(f"{loc(doc, key)}: {here + ': ' if here else ''}{key} must be true or false, got {value!r}")
    return value


def _no_unknown(doc: dict, allowed: set[str], loc, here: str) -> None:
    unknown = sorted(set(map(str, doc)) - allowed)
    if unknown:
        raise UserError(f"{loc(doc, unknown[0])}: {here + ': ' if here else ''}unknown key {unknown[0]!r}; "
                        f"valid keys: {', '.join(sorted(allowed))}")


def check_benchmarks(gauntlet: Gauntlet, tasks: list) -> None:
    """UserError (file, line, benchmark) for a benchmark that no task evaluates at that shot count."""
    shots = {t.label: list(t.num_fewshot) for t in tasks}
    for category in gauntlet.categories:
        for b in category.benchmarks:
            if b.num_fewshot in shots.get(b.name, []):
                continue
            have = (f"task {b.name!r} runs num_fewshot {shots[b.name]}" if b.name in shots
                    else f"no task is labelled {b.name!r} (labels: {', '.join(shots)})")
            raise UserError(f"{b.where} ({category.name}): benchmark {b.key} is not among the ICL tasks: {have}")


def benchmark_score(accuracy: float, benchmark: Benchmark) -> float:
    """Accuracy adjusted for chance: 0 at the random baseline, 1 when perfect (if rescaled)."""
    if not benchmark.subtract_random_baseline:
        return accuracy
    score = accuracy - benchmark.random_baseline
    if benchmark.rescale_accuracy:
        score /= 1.0 - benchmark.random_baseline
    return score


def benchmark_accuracy(result: dict[str, Any]) -> float:
    """A task's accuracy as the gauntlet sees it: the mean over its categories, if it has them."""
    categories = result.get("categories")
    if categories:
        return sum(float(c["accuracy"]) for c in categories.values()) / len(categories)
    return float(result["accuracy"])


def _weight(weighting: str, size: int) -> float:
    if weighting == "SAMPLE_SZ":
        return float(max(size, 1))
    if weighting == "LOG_SAMPLE_SZ":
        return max(math.log2(max(size, 1)), 1.0)
    return 1.0


def gauntlet_scores(results: dict[str, dict[str, Any]], gauntlet: Gauntlet) -> dict[str, Any]:
    """Category scores and averages from `evaluate_icl` results.

    Returns ``{"benchmarks": {key: score}, "categories": {name: score | None},
    "averages": {name: score | None}, "missing": [keys]}``. A category with a benchmark missing
    from `results` is None (not a partial score); an average is over its categories that have
    one, and None when none has (Foundry reports 0 there).
    """
    benchmarks: dict[str, float] = {}
    categories: dict[str, float | None] = {}
    missing: list[str] = []
    for category in gauntlet.categories:
        parts: list[tuple[float, float]] = []
        for b in category.benchmarks:
            result = results.get(b.key)
            if result is None:
                missing.append(b.key)
                continue
            benchmarks[b.key] = benchmark_score(benchmark_accuracy(result), b)
            size = int(result.get("size", result.get("n", 1)))  # the whole task, not just what --limit scored
            parts.append((benchmarks[b.key], _weight(gauntlet.weighting, size)))
        complete = len(parts) == len(category.benchmarks)
        total = sum(w for _, w in parts)
        categories[category.name] = sum(s * w for s, w in parts) / total if complete else None
    averages: dict[str, float | None] = {}
    for name, members in gauntlet.averages.items():
        present = [categories[m] for m in members if categories.get(m) is not None]
        averages[name] = sum(present) / len(present) if present else None
    return {"benchmarks": benchmarks, "categories": categories, "averages": averages, "missing": missing}


__all__ = ["WEIGHTINGS", "Benchmark", "Category", "Gauntlet", "load_gauntlet", "parse_gauntlet", "check_benchmarks",
           "benchmark_score", "benchmark_accuracy", "gauntlet_scores"]
