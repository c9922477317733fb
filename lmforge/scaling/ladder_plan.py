"""Planning a ladder: which model sizes train on how many tokens, within a budget.

The design is Hoffmann et al.'s IsoFLOP grid: ``levels`` compute levels C₁ < C₂ < … (each
``level_ratio`` times the one below) and at each level every ladder size N trains on
D = C / (6·N) tokens, so each level is a line of equal compute through the sizes and the grid
spans both N and D. Points that would be too short (fewer than ``min_steps`` optimizer steps: still
in their warmup transient) or would repeat the data more than ``max_epochs`` times are left out.
The top level is the largest whose runs fit the budget: on this machine each run costs its
tokens at the size's *measured* tokens/s (taken now, under the machine's present load) plus a
fixed start-up cost; runs go ``parallel`` at a time.

The sizes come from one family of shapes (`family`): width d, depth growing with it, heads of
32–64 dimensions, SwiGLU of ~8/3·d, tied embeddings; parameters counted in full (embeddings
too, as `model: auto` does). The ladder's largest is at most the target's parameters over
``target_gap``. The target itself: the given model, or (tokens or FLOPs alone) the family
shape the fitted law finds compute-optimal — before the fit, Chinchilla's 20 tokens per
parameter places it.

Every run gets the same recipe (the ladder file's run-config keys) and lmforge's size-aware
defaults, written out per run so the target's config says exactly what the law assumed: the
learning rate from the size (`learning_rate`), the batch from the size and run length. One
thing is held fixed instead of following each run: the warmup, in optimizer steps — the
target's default (5% of its steps) for every run. A warmup that grows with the run would
confound the token count with the warmup's length, and lmforge's 5% of a short run left the
wider ladder models unstable early: on tinyshakespeare a 200K-parameter model's 195-step run
ended 3.7% worse with its own 10-step warmup than with the target's 24 steps (3.851 against
3.713 held-out loss), off the law the other runs follow (BENCHMARKS.md, scaling ladder). No run
is shorter than four warmups.
Pure: the throughput and the data's size come in as arguments.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

from lmforge.config.defaults import MAX_WARMUP_STEPS, WARMUP_FRACTION, default_learning_rate
from lmforge.config.model import ModelConfig, padded_vocab, resolve_model
from lmforge.errors import UserError
from lmforge.config.counts import human
from lmforge.plan.batch import CPU_MICRO_BATCH, batch_samples
from lmforge.plan.auto import TOKENS_PER_PARAM  # Chinchilla's ratio: the target's prior before any fit
from lmforge.plan.flops import param_counts
from lmforge.scaling.config import LadderConfig
from lmforge.scaling.fit import FLOPS_PER_PARAM_TOKEN

SMALL_CONTEXT = 256  # the context of a ladder whose target is small (as `model: auto`'s CPU shapes)
LARGE_TARGET = 50e6  # parameters; a larger target's ladder trains at context 2048
WIDTHS = (32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072,
          4096, 5120, 6144, 8192)


def family_shape(d_model: int, vocab: int, context: int) -> ModelConfig:
    """The ladder family's shape of width ``d_model``: 2 layers at d 32–64, d/32 up to d 256, then
    4 more per doubling; heads of 32 dimensions (64 from d 320, 128 from d 2048)."""
    d = d_model
    layers = max(2, round(d / 32)) if d <= 256 else round(8 + 4 * math.log2(d / 256))
    head = 32 if d <= 256 else 64 if d < 2048 else 128
    heads = max(2, d // head)
    while d % heads:
        heads -= 1
    ffn = 32 * -(-int(8 * d / 3) // 32)
    return ModelConfig(d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn, vocab_size=padded_vocab(vocab),
                       max_seq_len=context, tie_embeddings=True)


def family(vocab: int, context: int) -> list[ModelConfig]:
    return [family_shape(d, vocab, context) for d in WIDTHS]


def params_of(model: ModelConfig) -> int:
    return param_counts(model)["total"]


def shape_label(model: ModelConfig) -> str:
    return f"{model.n_layers}x{model.d_model}"


def learning_rate(model: ModelConfig, optimizer: str = "adamw") -> float:
    """The peak LR a ladder run (and the target) trains with: lmforge's default for the size."""
    return default_learning_rate(param_counts(model)["non_embedding"], optimizer)


@dataclass
class Point:
    """One run of the ladder."""

    label: str  # e.g. "2x64-409k": shape and tokens (thousands), the run's name in the ladder
    model: dict  # ModelConfig fields
    params: int
    tokens: int
    level: int  # 0-based compute level
    flops: float  # 6·N·D
    learning_rate: float
    batch_tokens: int
    seconds: float | None  # estimated wall-clock seconds on this machine (time budgets)


@dataclass
class TargetPlan:
    model: dict | None  # None until the fit chooses it (a tokens- or FLOPs-only target)
    params: float
    tokens: float
    flops: float
    how: str  # "given" | "prior": Chinchilla's 20 tokens/param placed it before any fit


@dataclass
class LadderPlan:
    name: str
    points: list[Point]
    target: TargetPlan
    context: int
    vocab: int
    micro_batch: int
    eval_batches: int  # held-out micro-batches every run evaluates (the same samples for all)
    unique_tokens: float  # training data tokens (one epoch)
    warmup_steps: int | None  # every run's and the target's warmup (None: the ladder file sets one)
    budget: str
    estimated_seconds: float | None
    parallel: int
    threads: int
    tokens_per_s: dict = field(default_factory=dict)  # shape label → measured tokens/s
    overhead_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LadderPlan":
        d = dict(d)
        d["points"] = [Point(**p) for p in d["points"]]
        d["target"] = TargetPlan(**d["target"])
        return cls(**d)

    @property
    def largest(self) -> int:
        return max(p.params for p in self.points)


def run_batch_tokens(cfg: LadderConfig, model: ModelConfig, tokens: float, context: int) -> int:
    """Tokens per optimizer step: the ladder file's ``global_batch_size``, else lmforge's default for
    the size and run length — the planner's rule (`plan.batch.batch_samples`), as the target gets it."""
    return batch_samples(cfg.base_config.parameters, model, context, tokens) * context


def warmup_steps(cfg: LadderConfig, target: "TargetPlan", vocab: int, context: int) -> int | None:
    """The one warmup of the ladder's recipe: lmforge's default for the target run (5% of its steps,
    at most 2000); None when the ladder file gives ``parameters.warmup`` (then that one)."""
    if cfg.base_config.parameters.warmup is not None:
        return None
    model = target_model(cfg, vocab, context) or family_shape(WIDTHS[0], vocab, context)
    batch = run_batch_tokens(cfg, model, target.tokens, context)
    return max(1, round(min(MAX_WARMUP_STEPS, WARMUP_FRACTION * target.tokens / batch)))


def ladder_context(cfg: LadderConfig, target_params: float | None) -> int:
    ctx = cfg.base_config.parameters.context_length
    if ctx:
        return int(ctx)
    return 2048 if target_params and target_params > LARGE_TARGET else SMALL_CONTEXT


def target_model(cfg: LadderConfig, vocab: int, context: int) -> ModelConfig | None:
    if cfg.target.model is None:
        return None
    try:
        m = resolve_model(cfg.target.model)
    except ValueError as e:
        raise UserError(f"target.model: {e}") from None
    return m.model_copy(update={"vocab_size": padded_vocab(vocab), "max_seq_len": max(m.max_seq_len, context)})


def prior_target(cfg: LadderConfig, vocab: int, context: int) -> TargetPlan:
    """The target before any fit: given, or placed by Chinchilla's 20 tokens per parameter."""
    t = cfg.target
    model = target_model(cfg, vocab, context)
    if model is not None:
        n = params_of(model)
        d = t.tokens if t.tokens is not None else t.flops / (FLOPS_PER_PARAM_TOKEN * n)
        return TargetPlan(model.model_dump(mode="json"), n, d, FLOPS_PER_PARAM_TOKEN * n * d, "given")
    if t.tokens is not None:
        n = t.tokens / TOKENS_PER_PARAM
        return TargetPlan(None, n, t.tokens, FLOPS_PER_PARAM_TOKEN * n * t.tokens, "prior")
    n = math.sqrt(t.flops / (FLOPS_PER_PARAM_TOKEN * TOKENS_PER_PARAM))
    return TargetPlan(None, n, t.flops / (FLOPS_PER_PARAM_TOKEN * n), t.flops, "prior")


def ladder_sizes(cfg: LadderConfig, target: TargetPlan, vocab: int, context: int) -> list[ModelConfig]:
    """The ladder's shapes, smallest first: the family's (or the file's) below target / gap."""
    gap = cfg.ladder.target_gap
    limit = target.params / gap
    if cfg.ladder.models:
        shapes = []
        for i, spec in enumerate(cfg.ladder.models):
            try:
                m = resolve_model(spec)
            except (ValueError, UserError) as e:
                raise UserError(f"ladder.models[{i}]: {e}") from None
            shapes.append(m.model_copy(update={"vocab_size": padded_vocab(vocab), "max_seq_len": context}))
        shapes.sort(key=params_of)
        if params_of(shapes[-1]) > limit:
            raise UserError(f"target: {human(target.params)} parameters is less than {gap:g}× the ladder's largest "
                            f"model ({shape_label(shapes[-1])}, {human(params_of(shapes[-1]))}): give a bigger target "
                            "or smaller ladder.models")
        return shapes
    below = [m for m in family(vocab, context) if params_of(m) <= limit]
    if len(below) < 2:
        smallest = family(vocab, context)[1]
        what = "the target's model" if target.how == "given" else \
            f"the compute-optimal model for the target ({TOKENS_PER_PARAM:g} tokens per parameter)"
        raise UserError(f"target: {what} has {human(target.params)} parameters, less than {gap:g}× the ladder's "
                        f"second smallest model ({shape_label(smallest)}, {human(params_of(smallest))} with this "
                        f"{vocab}-token vocabulary): a ladder needs at least two sizes below the target; give a "
                        "bigger target (more tokens or FLOPs, or a bigger model)")
    return below[-cfg.ladder.sizes:]


def plan_ladder(cfg: LadderConfig, *, vocab: int, context: int, unique_tokens: float, val_tokens: float,
                tokens_per_s: Callable[[ModelConfig], float] | None = None, overhead_s: float = 0.0,
                threads: int = 1) -> LadderPlan:
    """The ladder for ``cfg``. ``tokens_per_s`` (time budgets): a shape's training rate on this
    machine now; ``overhead_s``: a run's cost besides training (start-up, evaluation, export)."""
    opts = cfg.ladder
    target = prior_target(cfg, vocab, context)
    # Every run and the target take the planner's CPU micro-batch, so that `eval.max_batches` of them
    # are the same held-out samples for all (their batches are whole multiples of it).
    micro = CPU_MICRO_BATCH
    eval_batches = int(val_tokens // context) // micro
    if eval_batches < 1:
        raise UserError(f"eval: the held-out data has {human(val_tokens)} tokens, less than one batch of {micro} × "
                        f"{context} tokens; give more held-out data (eval.data_path, or a larger "
                        "eval.holdout_fraction)")
    max_tokens = opts.max_epochs * unique_tokens
    if target.tokens > max_tokens:
        raise UserError(f"train_data: {human(unique_tokens)} tokens is too small for the target's "
                        f"{human(target.tokens)} ({target.tokens / unique_tokens:.1f} epochs, more than "
                        f"ladder.max_epochs = {opts.max_epochs:g}): give more training data or fewer target tokens")
    sizes = ladder_sizes(cfg, target, vocab, context)
    warmup = warmup_steps(cfg, target, vocab, context)
    min_steps = max(opts.min_steps, 4 * (warmup or 0))
    rates = {}
    if cfg.budget.unit == "s":
        if tokens_per_s is None:
            raise ValueError("a time budget needs tokens_per_s")
        # A bigger shape is never faster: a measurement that says so caught a quieter moment.
        fastest = math.inf
        for m in sizes:  # smallest first
            fastest = min(fastest, float(tokens_per_s(m)))
            rates[shape_label(m)] = fastest

    per_size = [(m, params_of(m), shape_label(m), learning_rate(m, cfg.optimizer)) for m in sizes]
    dumps: dict[str, dict] = {}

    def points_at(c_top: float, levels: int = opts.levels) -> list[Point]:
        """The grid under a top level of ``c_top`` FLOPs, its lowest levels dropped to keep ``levels``."""
        pts = []
        for k in range(opts.levels - levels, opts.levels):
            c = c_top / opts.level_ratio ** (opts.levels - 1 - k)
            for m, n, label, lr in per_size:
                d = c / (FLOPS_PER_PARAM_TOKEN * n)
                b = run_batch_tokens(cfg, m, d, context)
                steps = round(d / b)
                tokens = steps * b
                if steps < min_steps or tokens > max_tokens:
                    continue
                secs = tokens / rates[label] + overhead_s if rates else None
                model = dumps.get(label) or dumps.setdefault(label, m.model_dump(mode="json"))
                pts.append(Point(f"{label}-{tokens // 1000}k", model, n, tokens, k,
                                 FLOPS_PER_PARAM_TOKEN * n * tokens, lr, b, secs))
        return pts

    def cost(pts: list[Point]) -> float:
        if cfg.budget.unit == "flop":
            return sum(p.flops for p in pts)
        return makespan([p.seconds for p in pts], opts.parallel)

    best, cheapest = _search(cfg, sizes, points_at, cost, min_steps)
    if best is None:
        raise UserError(_no_fit_reason(cfg, sizes, rates, overhead_s, max_tokens, unique_tokens, context, cheapest,
                                       min_steps))
    notes = []
    if len({p.params for p in best}) < len(sizes):
        left = [shape_label(m) for m in sizes if params_of(m) not in {p.params for p in best}]
        notes.append(f"left out {', '.join(left)}: no run of them fits the budget with ≥ {min_steps} steps")
    est = makespan([p.seconds for p in best], opts.parallel) if rates else None
    return LadderPlan(cfg.name, sorted(best, key=lambda p: (p.level, p.params)), target, context, vocab, micro,
                      eval_batches, unique_tokens, warmup, str(cfg.budget), est, opts.parallel, threads, rates,
                      overhead_s, notes)


def _search(cfg: LadderConfig, sizes: list[ModelConfig], points_at, cost, min_steps: int):
    """(the best grid within the budget or None, the cheapest grid's cost): scan the top level's
    compute over a fine geometric grid, with all levels and with the lowest ones dropped (a small
    budget buys fewer, larger runs); keep the plan that covers the most sizes, then has the most
    points (up to what the fit needs), then the most compute."""
    opts = cfg.ladder
    smallest = min(params_of(m) for m in sizes)
    best, best_key, cheapest = None, None, math.inf
    for levels in range(opts.levels, 0, -1):
        c = FLOPS_PER_PARAM_TOKEN * smallest * min_steps * 1024
        seen = False
        for _ in range(600):
            pts = points_at(c, levels)
            if len(pts) >= 2:
                cheapest = min(cheapest, cost(pts))
            if pts and cost(pts) <= cfg.budget.value and len(pts) >= 2:
                key = (len({p.params for p in pts}), min(len(pts), WANTED_POINTS), c)
                if best_key is None or key > best_key:
                    best, best_key = pts, key
            seen = seen or bool(pts)
            if seen and not pts:
                break
            c *= 1.05
    return best, cheapest


WANTED_POINTS = 9  # a 5-parameter law with a few degrees of freedom left to judge the fit


def _no_fit_reason(cfg, sizes, rates, overhead_s, max_tokens, unique_tokens, context, cheapest, min_steps) -> str:
    """Why no plan of two runs fits: the data, or the budget (and what the cheapest plan needs)."""
    opts = cfg.ladder
    m = sizes[0]
    b = run_batch_tokens(cfg, m, min_steps * 2048, context)
    shortest = min_steps * b
    if shortest > max_tokens or cheapest == math.inf:
        return (f"train_data: {human(unique_tokens)} tokens is too small for the ladder: its shortest run "
                f"({min_steps} steps × {human(b)} tokens) would repeat it more than ladder.max_epochs = "
                f"{opts.max_epochs:g} times; give more training data")
    if cfg.budget.unit == "flop":
        return (f"budget: {cfg.budget} cannot fit two ladder runs of at least {min_steps} steps (the cheapest "
                f"such ladder needs {cheapest:.2g} FLOPs): give a larger budget")
    one = shortest / rates[shape_label(m)] + overhead_s
    return (f"budget: {cfg.budget} cannot fit two ladder runs on this machine now (the shortest, {min_steps} "
            f"steps of {shape_label(m)} at {human(rates[shape_label(m)])} tokens/s measured, takes about {one:.0f}s "
            f"with its start-up; the cheapest ladder about {cheapest:.0f}s): give at least "
            f"{math.ceil(cheapest / 60)}min")


def makespan(seconds: list[float], parallel: int) -> float:
    """Wall-clock time of jobs run ``parallel`` at a time, longest first, each on the first free slot."""
    slots = [0.0] * max(1, parallel)
    for s in sorted(seconds, reverse=True):
        i = slots.index(min(slots))
        slots[i] += s
    return max(slots)
