"""The shape of the code, checked: which package may import which (docs/architecture.md).

Data flows one way — config → data → models → train — and the core (`models`, `data`, `train`,
`distributed`) never reaches out to the operations around it (`runs`, `cli`, the trackers).
Reads the import statements (module level and inside functions) with `ast`; runs in well under
a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lmforge"
CORE = ("models", "data", "train", "distributed")
OPERATIONS = ("runs", "cli", "tracking", "report")
# package → packages of lmforge it must never import
FORBIDDEN = {
    "config": ("data", "models", "train", "distributed", "eval", "runs", "cli", "tracking", "estimate", "report"),
    "data": ("models", "train", "runs", "cli", "tracking"),
    "models": ("train", "runs", "cli", "tracking", "eval"),
    "distributed": ("train", "runs", "cli", "tracking"),
    "train": OPERATIONS,
    "eval": ("train",) + OPERATIONS,
    "estimate": ("train", "runs", "cli", "tracking", "report"),
    "report": ("models", "train", "distributed", "cli"),  # reads a run's files; never trains
    # plans, fits and predicts from numbers; running the ladder is `runs.ladder`'s
    "scaling": ("data", "models", "train", "distributed", "eval", "runs", "cli", "tracking", "report"),
}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("lmforge.")}


def package_of(module: str) -> str:
    return module.split(".")[1]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for module in imports_of(path):
            if package_of(module) in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PKG.parent)} imports {module}")
    assert not bad, "\n".join(bad)


def test_trainer_does_not_depend_on_finetuning():
    """Fine-tuning builds on the trainer, never the reverse."""
    mods = imports_of(PKG / "train" / "trainer.py")
    assert not any(m.startswith(("lmforge.train.finetune", "lmforge.train.setup")) for m in mods), mods


def test_core_never_branches_on_attributes():
    """Declared protocols (Batch, BatchStream, TrainingData with its `kind`) instead of hasattr."""
    for package in ("train",):
        for path in (PKG / package).rglob("*.py"):
            assert "hasattr(" not in path.read_text(), path
