"""`resolve`: the one path from what a user asked for to a frozen, fully resolved run.

Every command that needs a run's numbers calls it — `train` and `finetune` (each process:
the supervisor to check, every rank to train), `--dry-run`, preflight, `estimate` and the
benches — and nothing changes a config after it. The steps, in order:

1. the request's config: weights to continue from fill `model` / `tokenizer`, names filled
   (`resolve.request.run_config`);                                        → stage ``"config"``
2. `model: auto` sized for the budget on this machine (rank 0 times candidates, every rank takes
   its choice), or a fine-tuning run's tokenizer, chat template and sampling defaults;
3. the data: raw text tokenized, curated and packed into the cache by rank 0 first (its bad-input
   error reaches every rank); fine-tuning rows packed at the context;       (stage ``"run"`` only)
4. the model's vocabulary from the tokenizer, its context from the run's;
5. the plan (`plan.run.make_plan`): batch, steps, LR, schedule, intervals, precision;
   a curriculum's phases put on optimizer steps;                          → stage ``"plan"``/``"run"``
6. the resolved config: every default written in (what `--dry-run` prints, checkpoints keep).

Stage ``"plan"`` stops short of preparing data: facts about data come from what is already
prepared, as a dry run needs.
"""

from __future__ import annotations

from lmforge.config.identity import with_default_names
from lmforge.config.schema import RunConfig
from lmforge.plan.machine import Machine
from lmforge.resolve.request import RunRequest, run_config
from lmforge.resolve.resolved import ResolvedRun, Stage

__all__ = ["Machine", "ResolvedRun", "RunRequest", "Stage", "resolve"]

def resolve(request: RunRequest | RunConfig | ResolvedRun, machine: Machine | None = None, *, until: Stage = "run",
            log=print) -> ResolvedRun:
    """Resolve ``request`` (or an already validated config) for ``machine`` up to stage ``until``;
    a run resolved to stage "config" goes on from there (what a job does: its lock and credentials
    come first, from the same config)."""
    if isinstance(request, ResolvedRun):
        cfg = request.config
    else:
        cfg = run_config(request) if isinstance(request, RunRequest) else with_default_names(request)
    if until == "config":
        return ResolvedRun(cfg)
    if machine is None:
        raise ValueError("resolve: a machine is needed beyond the config stage")
    from lmforge.resolve.steps import resolve_run  # torch (data, tokenizers): not needed for the config stage

    return resolve_run(cfg, machine, until, log)
