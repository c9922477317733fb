"""The shape of the code, checked: which package may import which (docs/architecture.md).

Data flows one way — config → resolved run → data → models → train — and the core (`models`,
`data`, `train`, `distributed`) never reaches out to the operations around it (`runs`, `cli`,
the trackers, reports). The layers, from the bottom:

    errors, home, run_files, checksums, process, secrets, say,   (small shared modules)
    uri, guard
    config · tasks · rewards                                    torch-free: the rules and constants (rewards:
                                                                what scores reinforcement learning's completions)
    plan                                                        torch-free: the one planner (FLOPs, memory,
                                                                batch, checks, model: auto, the run plan,
                                                                schedule, the estimate as its view)
    scaling                                                     torch-free: scaling-law ladders planned, fitted
    goodput                                                     torch-free: conditions, health, cordon, ledger, faults
    resolve (request, weights, auto_model)                      torch-free: one run resolved, through plan
    data · models · distributed · eval                          the torch core
    resolve.steps                                               resolution past the config stage
    train                                                       the builder (train.build) and the trainer
    tracking · report                                           what a person looks at
    runs                                                        registry, supervisor, jobs
    cli                                                         commands

Reads the import statements (module level and inside functions) with `ast`; runs in about a second.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lmforge"
EVERYTHING = ("config", "tasks", "rewards", "plan", "scaling", "goodput", "resolve", "data", "models", "distributed", "eval", "train",
              "tracking", "report", "runs", "cli")


def above(package: str) -> tuple[str, ...]:
    """The packages listed after ``package`` in EVERYTHING."""
    return EVERYTHING[EVERYTHING.index(package) + 1:]


# package → packages of lmforge it must never import (a layer never imports the layers above it,
# nor its siblings where they must stay independent).
FORBIDDEN = {
    "config": above("config"),
    "tasks": tuple(p for p in above("config") if p != "tasks"),  # beside config: read by eval and curation alike
    # beside config and tasks: rules that score text, read by resolution and the trainer; no torch
    "rewards": ("config", "tasks") + above("rewards"),
    "plan": above("plan"),
    # plans, fits and predicts from numbers; running the ladder is `runs.ladder`'s
    "scaling": above("scaling"),
    # the rules of a run's goodput (no torch): the trainer, the supervisor and the report read them
    "goodput": above("goodput"),
    "resolve": ("eval", "train", "tracking", "report", "runs", "cli"),
    "data": ("models", "distributed", "eval", "train", "tracking", "report", "runs", "cli", "resolve"),
    "models": ("distributed", "eval", "train", "tracking", "report", "runs", "cli", "resolve"),
    "distributed": ("eval", "train", "tracking", "report", "runs", "cli", "resolve"),
    "eval": ("train", "tracking", "report", "runs", "cli", "resolve"),
    "train": ("tracking", "report", "runs", "cli"),
    "tracking": ("report", "runs", "cli"),
    "report": ("models", "train", "distributed", "runs", "cli"),  # reads a run's files; never trains
    "runs": ("cli",),
}
SHARED_MODULES = ("errors", "home", "run_files", "checksums", "process", "secrets", "say", "uri", "guard", "frozen")
# Modules that must load without torch: `lmforge --help`, `estimate`, a run's resolution up to its
# plan and the command a user starts (its preflight plans a CPU run, then it supervises) stay light,
# and the rules live in one torch-free layer that torch code imports.
TORCH_FREE = ["lmforge.cli.main", "lmforge.cli.estimate", "lmforge.run_files", "lmforge.guard", "lmforge.frozen", "lmforge.plan.layout", "lmforge.config.limits", "lmforge.resolve", "lmforge.plan.run",
              "lmforge.plan.machine", "lmforge.resolve.request", "lmforge.resolve.weights",
              "lmforge.resolve.auto_model", "lmforge.plan.schedule", "lmforge.tasks.icl",
              "lmforge.plan.estimate", "lmforge.plan.auto", "lmforge.plan.memory", "lmforge.plan.activations", "lmforge.plan.batch",
              "lmforge.plan.checks", "lmforge.plan.fit", "lmforge.plan.context", "lmforge.plan.micro_batch",
              "lmforge.plan.flops", "lmforge.plan.hardware", "lmforge.plan.comm", "lmforge.plan.cost", "lmforge.plan.evaluation",
              "lmforge.config.counts", "lmforge.cli.train", "lmforge.runs.preflight", "lmforge.resolve.steps",
              "lmforge.data.prepare.prepared", "lmforge.data.chat", "lmforge.train.machine", "lmforge.runs.launcher",
              "lmforge.config.defaults", "lmforge.config.load", "lmforge.data.pieces", "lmforge.models.gguf_vocab", "lmforge.scaling.ladder_plan",
              "lmforge.scaling.fit", "lmforge.scaling.predict", "lmforge.goodput.conditions",
              "lmforge.goodput.health", "lmforge.goodput.diagnosis", "lmforge.goodput.cordon",
              "lmforge.goodput.ledger", "lmforge.goodput.faults", "lmforge.plan.goodput", "lmforge.goodput.interval",
              "lmforge.rewards.functions", "lmforge.rewards.answers"]


@functools.cache
def nodes_of(path: Path) -> tuple[ast.AST, ...]:
    """Every node of a file's syntax tree (``ast.walk`` order), parsed once for all the tests here."""
    return tuple(ast.walk(ast.parse(path.read_text(), str(path))))


@pytest.fixture(scope="module", autouse=True)
def _parsed_once():
    """The package parsed before the first test times itself: each test reads the same trees."""
    for path in PKG.rglob("*.py"):
        nodes_of(path)
    module_graph()


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in nodes_of(path):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("lmforge.")}


def package_of(module: str) -> str:
    return module.split(".")[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def module_imports(path: Path, modules: set[str]) -> set[str]:
    """The lmforge modules ``path`` imports: `from a.b import c` is a.b.c where that is a module
    (a submodule taken from its package), else a.b."""
    found = set()
    for node in nodes_of(path):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found.update(subs if subs <= modules else {node.module})
    out = set()
    for m in found:
        while m.startswith("lmforge.") and m not in modules:
            m = m.rsplit(".", 1)[0]
        if m in modules:
            out.add(m)
    return out


@functools.cache
def module_graph() -> dict[str, set[str]]:
    """lmforge module → the lmforge modules it imports."""
    paths = sorted(PKG.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): module_imports(p, modules) - {module_name(p)} for p in paths}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    bad = []
    for path in sorted((PKG / package).rglob("*.py")):
        for module in imports_of(path):
            if package_of(module) in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(PKG.parent)} imports {module}")
    assert not bad, "\n".join(bad)


def test_every_package_has_its_layer():
    """A new package must say where it sits (add it to EVERYTHING and FORBIDDEN)."""
    packages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert packages <= set(EVERYTHING), sorted(packages - set(EVERYTHING))
    assert set(FORBIDDEN) | {"cli"} == set(EVERYTHING)


def test_shared_modules_import_only_each_other_and_config():
    """The small top-level modules sit under every package (config aside: secrets reads its files)."""
    bad = []
    for name in SHARED_MODULES:
        for module in imports_of(PKG / f"{name}.py"):
            top = package_of(module)
            if top not in SHARED_MODULES and top not in ("config", "data"):
                bad.append(f"lmforge/{name}.py imports {module}")
    assert not bad, "\n".join(bad)
    assert not [m for m in imports_of(PKG / "errors.py")], "errors knows nothing of the rest (secrets included)"


def test_no_import_circles():
    """No two modules import each other, directly or through others (imports inside functions count)."""
    found = circles(module_graph())
    assert not found, "\n".join(" → ".join(c) for c in found)


# lmforge/data's folders, in the order data flows through them: each may import the folders named
# here and the shared modules at data/'s top (mds, remote, batch, chat, pieces), which import none.
DATA_FLOW = {"text": (), "curate": (), "prepare": ("text", "curate"), "stream": ("text", "prepare"),
             "rows": ("text",)}


def test_data_flows_one_way_through_its_folders():
    """raw text → (curation rules) → the prepare job → the training stream; fine-tuning rows beside it."""
    data = PKG / "data"
    folders = {p.name for p in data.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(DATA_FLOW), sorted(folders ^ set(DATA_FLOW))
    bad = []
    for path in data.rglob("*.py"):
        rel = path.relative_to(data).parts
        mine = rel[0] if len(rel) > 1 else None
        allowed = DATA_FLOW[mine] if mine else ()
        for module in imports_of(path):
            parts = module.split(".")
            if parts[1] != "data" or len(parts) < 3 or parts[2] not in folders or parts[2] == mine:
                continue
            if parts[2] not in allowed:
                bad.append(f"{path.relative_to(PKG.parent)} imports {module}")
    assert not bad, "\n".join(bad)


def test_no_package_circles():
    graph: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        top = module.split(".")[1] if module.count(".") else module
        graph.setdefault(top, set()).update(t.split(".")[1] for t in targets if t.count("."))
    for top in graph:
        graph[top].discard(top)
    found = circles(graph)
    assert not found, "\n".join(" ↔ ".join(c) for c in found)


@pytest.mark.integration  # a fresh interpreter importing the whole rules layer: about a CPU second
def test_the_rules_layer_loads_without_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + \
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_one_function_resolves_a_run():
    """`resolve` is the only path to a run's plan: nothing outside lmforge/resolve makes one, sizes
    `model: auto` or names a run (the planner defines them; `resolve` calls them)."""
    import re

    calls = re.compile(r"(?<!def )\b(make_plan|resolve_auto|with_default_names)\(")
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "resolve") or path == PKG / "config" / "identity.py":
            continue
        bad += [f"{path.relative_to(PKG.parent)} calls {m}" for m in sorted(set(calls.findall(path.read_text())))]
    assert not bad, "\n".join(bad)


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in nodes_of(path):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


def test_trainer_does_not_depend_on_resolution_steps():
    """The trainer takes a resolved run; it never resolves one itself."""
    mods = imports_of(PKG / "train" / "trainer.py")
    assert not any(m.startswith(("lmforge.resolve.steps", "lmforge.plan.run.make_plan")) for m in mods), mods


def test_the_trainer_takes_its_parts_from_the_builder():
    """The Trainer file holds the loop, evaluation hooks and checkpointing; what a run trains with
    (model, wrapping, LoRA, optimizer, objective, streams, the checkpoint loaded, ICL tasks, expert
    health, the background saver, stop, watchdog and telemetry) is built in `train.build`, and the
    device's peak comes from the plan's layout (never detected again)."""
    mods = imports_of(PKG / "train" / "trainer.py")
    building = ("lmforge.models.build_model", "lmforge.models.lora", "lmforge.distributed.parallelize.parallelize",
                "lmforge.train.optim.build_optimizer", "lmforge.train.objective", "lmforge.data.batch.StreamLayout",
                "lmforge.train.telemetry", "lmforge.train.watchdog", "lmforge.train.stop", "lmforge.train.expert_health",
                "lmforge.eval.in_training.load_icl", "lmforge.train.resume", "lmforge.train.build",
                "lmforge.plan.hardware.detect_device_spec", "lmforge.plan.hardware.peak_flops")
    assert not any(m.startswith(building) for m in mods), sorted(m for m in mods if m.startswith(building))
    assert "lmforge.train.parts.TrainingParts" in mods
    init = next(n for n in nodes_of(PKG / "train" / "trainer.py")
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    calls = {c.func.id for c in ast.walk(init) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)} - {"bool"}
    assert not calls, f"Trainer.__init__ constructs {sorted(calls)}: build it in train.build"


def test_core_never_branches_on_attributes():
    """Declared protocols (Batch, BatchStream, TrainingData with its `kind`) instead of hasattr."""
    for package in ("train", "resolve"):
        for path in (PKG / package).rglob("*.py"):
            assert "hasattr(" not in path.read_text(), path


LAYOUT_KEYS = {"compute": {"context_parallel", "data_parallel", "expert_parallel", "shard_size"},
               "parameters": {"micro_batch_size", "global_batch_size"}}
PLANNING = ("plan", "config", "resolve", "cli")


def test_only_the_planner_reads_the_layout_from_the_config():
    """The parallel layout and the batch split are the plan's (`plan.layout.Layout`): outside the
    planner, the config, resolution and the CLI, no code reads them from `compute.*` or the batch sizes
    of `parameters.*` — directly or through an alias (``c = cfg.compute; c.data_parallel``)."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] in PLANNING:
            continue
        aliases = {section: {"compute" if section == "compute" else "parameters"} for section in LAYOUT_KEYS}
        for node in nodes_of(path):  # `c = cfg.compute` / `p = cfg.parameters`: an alias of the section
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute) and \
                    node.value.attr in LAYOUT_KEYS:
                aliases[node.value.attr] |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in nodes_of(path):
            if not isinstance(node, ast.Attribute):
                continue
            for section, keys in LAYOUT_KEYS.items():
                base = node.value
                named = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else None
                if node.attr in keys and named in aliases[section]:
                    found.append(f"lmforge/{rel}:{node.lineno} reads {section}.{node.attr}")
    assert not found, "\n".join(found)
