"""The gauntlet: ICL accuracies grouped into category scores and named averages.

Reads LLM Foundry's ``eval_gauntlet`` YAML (``weighting``, ``subtract_random_baseline``,
``rescale_accuracy``, ``averages``, ``categories`` of ``benchmarks`` with ``name``,
``num_fewshot`` and ``random_baseline``), so its gauntlet files carry over. A benchmark's score is
its accuracy, minus the random baseline, divided by ``1 - baseline`` (so chance is 0 and perfect
is 1); a category is the weighted mean of its benchmarks; an average is the plain mean of the
categories it names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from lmforge.config.load import load_yaml_text, read_text_file
from lmforge.errors import UserError

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


def load_gauntlet(path: str | Path) -> Gauntlet:
    """Load a gauntlet YAML (``"default"`` is the shipped one); UserError naming the bad field."""
    path = DEFAULT_GAUNTLET if str(path) == "default" else Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"gauntlet file {path} not found")
    doc = load_yaml_text(read_text_file(str(path), "gauntlet file"), str(path))
    if isinstance(doc, dict) and "eval_gauntlet" in doc:
        doc = doc["eval_gauntlet"]
    return parse_gauntlet(doc, str(path))


def parse_gauntlet(doc: Any, where: str = "eval.gauntlet") -> Gauntlet:
    """Build a Gauntlet from an already-parsed mapping (Foundry's `eval_gauntlet` section)."""
    if not isinstance(doc, dict):
        raise UserError(f"{where}: expected a mapping with `categories:` (optionally under `eval_gauntlet:`)")
    _no_unknown(doc, _TOP_KEYS, where)
    weighting = str(doc.get("weighting", "EQUAL")).upper()
    if weighting not in WEIGHTINGS:
        raise UserError(f"{where}: weighting {doc.get('weighting')!r} is not one of {', '.join(WEIGHTINGS)}")
    subtract = _flag(doc, "subtract_random_baseline", True, where)
    rescale = _flag(doc, "rescale_accuracy", True, where)
    raw_categories = doc.get("categories")
    if not isinstance(raw_categories, list) or not raw_categories:
        raise UserError(f"{where}: categories must be a non-empty list")
    categories: list[Category] = []
    for i, raw in enumerate(raw_categories):
        here = f"{where}: categories[{i}]"
        if not isinstance(raw, dict):
            raise UserError(f"{here}: expected a mapping with name and benchmarks")
        _no_unknown(raw, _CATEGORY_KEYS, here)
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise UserError(f"{here}: field 'name' is required (a non-empty string)")
        if any(c.name == name for c in categories):
            raise UserError(f"{here}: duplicate category name {name!r}")
        cat_subtract = _flag(raw, "subtract_random_baseline", subtract, here)
        cat_rescale = _flag(raw, "rescale_accuracy", rescale, here)
        raw_benchmarks = raw.get("benchmarks")
        if not isinstance(raw_benchmarks, list) or not raw_benchmarks:
            raise UserError(f"{here} ({name}): benchmarks must be a non-empty list")
        benchmarks = [_benchmark(b, f"{here} ({name}): benchmarks[{j}]", cat_subtract, cat_rescale)
                      for j, b in enumerate(raw_benchmarks)]
        categories.append(Category(name, benchmarks))
    names = [c.name for c in categories]
    averages = doc.get("averages")
    if averages is None:
        averages = {"default_average": names}  # Foundry's default: all categories
    if not isinstance(averages, dict):
        raise UserError(f"{where}: averages must be a mapping of name to a list of category names")
    for avg, members in averages.items():
        if not isinstance(members, list) or not members:
            raise UserError(f"{where}: averages.{avg} must be a non-empty list of category names")
        for m in members:
            if m not in names:
                raise UserError(f"{where}: averages.{avg} names unknown category {m!r}; categories: {', '.join(names)}")
    return Gauntlet(categories, weighting, {str(k): list(v) for k, v in averages.items()}, where)


def _benchmark(raw: Any, where: str, subtract: bool, rescale: bool) -> Benchmark:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping with name, num_fewshot, random_baseline")
    _no_unknown(raw, _BENCHMARK_KEYS, where)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: field 'name' is required (the ICL task label)")
    shots = raw.get("num_fewshot")
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise UserError(f"{where} ({name}): num_fewshot must be a non-negative integer, got {shots!r}")
    baseline = raw.get("random_baseline", 0.0)
    if not isinstance(baseline, (int, float)) or isinstance(baseline, bool) or not 0 <= baseline < 1:
        raise UserError(f"{where} ({name}): random_baseline must be a number in [0, 1), got {baseline!r}")
    return Benchmark(name, shots, float(baseline), _flag(raw, "subtract_random_baseline", subtract, where),
                     _flag(raw, "rescale_accuracy", rescale, where))


def _flag(doc: dict, key: str, default: bool, where: str) -> bool:
    value = doc.get(key, default)
    if not isinstance(value, bool):
        raise UserError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _no_unknown(doc: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(map(str, doc)) - allowed)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(sorted(allowed))}")


def benchmark_score(accuracy: float, benchmark: Benchmark) -> float:
    """Accuracy adjusted for chance: 0 at the random baseline, 1 when perfect (if rescaled)."""
    if not benchmark.subtract_random_baseline:
        return accuracy
    score = accuracy - benchmark.random_baseline
    if benchmark.rescale_accuracy:
        score /= 1.0 - benchmark.random_baseline
    return score


def _weight(weighting: str, n: int) -> float:
    if weighting == "SAMPLE_SZ":
        return float(max(n, 1))
    if weighting == "LOG_SAMPLE_SZ":
        return math.log(max(n, 2))
    return 1.0


def gauntlet_scores(results: dict[str, dict[str, Any]], gauntlet: Gauntlet) -> dict[str, Any]:
    """Category scores and averages from `evaluate_icl` results.

    Returns ``{"benchmarks": {key: score}, "categories": {name: score | None},
    "averages": {name: score | None}, "missing": [keys]}``. A category with a benchmark missing
    from `results` is None (not a partial score); an average is over its categories that have one.
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
            benchmarks[b.key] = benchmark_score(float(result["accuracy"]), b)
            parts.append((benchmarks[b.key], _weight(gauntlet.weighting, int(result.get("n", 1)))))
        complete = len(parts) == len(category.benchmarks)
        total = sum(w for _, w in parts)
        categories[category.name] = sum(s * w for s, w in parts) / total if complete else None
    averages: dict[str, float | None] = {}
    for name, members in gauntlet.averages.items():
        present = [categories[m] for m in members if categories.get(m) is not None]
        averages[name] = sum(present) / len(present) if present else None
    return {"benchmarks": benchmarks, "categories": categories, "averages": averages, "missing": missing}


__all__ = ["WEIGHTINGS", "Benchmark", "Category", "Gauntlet", "load_gauntlet", "parse_gauntlet",
           "benchmark_score", "gauntlet_scores"]
