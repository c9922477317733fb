"""Weights & Biases tracking (online, or offline files under the run folder).

wandb is imported lazily. ``finish()`` also tears down wandb's background
service process so nothing outlives the run.
"""

from __future__ import annotations

import os
import re
import secrets
import sys

from lmforge.config.tracking import WandbConfig
from lmforge.tracking.base import Tracker, flatten_params, one_line, scalar_metrics

MODES = ("online", "offline", "disabled")
EXIT_CODE = {"completed": 0, "failed": 1, "stopped": 1}


def resolve_mode(cfg: WandbConfig) -> str:
    mode = cfg.mode or os.environ.get("WANDB_MODE") or "online"
    # wandb also accepts "dryrun" and "run" as old spellings.
    mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"W&B mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class WandbTracker(Tracker):
    """One W&B run whose files live in run_dir/wandb; ``run_id`` given means resume it."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_name: str, run_dir: str | os.PathLike,
                 run_id: str | None = None, init_timeout: float = 30.0) -> None:
        import wandb

        self.mode = resolve_mode(cfg)
        if self.mode == "online" and not wandb.login(prompt=False, verify=False):
            # wandb would otherwise stop a run on a TTY to ask for a key.
            raise RuntimeError("no W&B API key: set WANDB_API_KEY, run `wandb login`, "
                               "or use experiment_tracker.wandb.mode: offline")
        self.run_id = run_id or secrets.token_hex(4)  # W&B ids: lowercase alphanumerics
        os.makedirs(run_dir, exist_ok=True)
        settings = wandb.Settings(
            console="off",          # never wrap stdout: the progress bar owns the terminal
            silent=True,
            x_disable_stats=True,   # no system-metrics sampler thread
            x_save_requirements=False,
            init_timeout=init_timeout,
        )
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=run_name, dir=str(run_dir),
                mode=self.mode, id=self.run_id, resume="allow", settings=settings,
                reinit="create_new",  # several runs may share a process (tests, sweeps)
            )
        except BaseException:
            wandb.teardown()  # a failed init may already have started the service
            raise
        self._tables: dict[str, list[list]] = {}

    def log_params(self, params: dict) -> None:
        flat = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                for k, v in flatten_params(params).items()}
        self.run.config.update(flat, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(scalar_metrics(metrics), step=int(step))

    def log_text(self, key: str, text: str, step: int) -> None:
        import wandb

        # One growing table per key, so the UI shows every eval's generations together.
        rows = self._tables.setdefault(key, [])
        rows.append([int(step), text])
        self.run.log({key: wandb.Table(columns=["step", "text"], data=list(rows))}, step=int(step))

    def log_model(self, final_dir: str) -> None:
        """The final export (weights + tokenizer) as a W&B ``model`` artifact of this run; a failure
        is a warning, the run is complete."""
        import wandb

        try:
            name = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{self.run.name or self.run_id}-model")
            artifact = wandb.Artifact(name, type="model", description="lmforge final model (lmforge-model.json, "
                                      "safetensors, tokenizer)", metadata={"format": "lmforge", "folder": final_dir})
            artifact.add_dir(final_dir)
            self.run.log_artifact(artifact, aliases=["latest", "final"])
        except Exception as exc:  # noqa: BLE001 - never fail a finished run over its upload
            print(f"warning: W&B: could not log the final model {final_dir} as an artifact ({one_line(exc)})",
                  file=sys.stderr, flush=True)

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        import wandb

        try:
            if status == "stopped":
                self.run.mark_preempting()  # shown as resumable rather than crashed
            self.run.finish(exit_code=EXIT_CODE.get(status, 0))
        finally:
            wandb.teardown()  # stop the wandb-core service process
