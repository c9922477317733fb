"""How the operations layer hooks into training without the trainer knowing it.

Trackers (console, metrics.jsonl, MLflow, W&B), the object-store mirror of a remote save
folder and the run registry live outside the core (`models`, `data`, `train`, `distributed`).
They implement some of these methods; the trainer calls them on rank 0 only, in this order:

    before_resume → resume_decided → on_start → (on_metrics | on_text | on_checkpoint)* → on_end

A callback that raises stops the run (the object store must not silently stop mirroring);
trackers that may fail harmlessly guard themselves (`tracking.Trackers`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunInfo:
    """What a callback learns when training starts."""

    name: str
    save_folder: str  # where checkpoints are written (a local staging folder for remote runs)
    resumed: bool  # continuing from a checkpoint of this run
    config: dict  # the resolved config, secrets redacted
    plan: dict  # parameter counts, world size, accumulation, steps
    total_steps: int | None  # None: a wall-clock budget
    total_tokens: int | None


class Callback:
    """Every hook is a no-op by default; override the ones you need."""

    def before_resume(self, save_folder: str) -> None:
        """Before the save folder's run identity is checked (e.g. fetch a remote run.json)."""

    def resume_decided(self, save_folder: str, resume: bool, overwrite: bool) -> None:
        """Before the latest checkpoint is looked up (e.g. download it from a remote store)."""

    def on_start(self, info: RunInfo) -> None:
        """Model built, checkpoint (if any) loaded; the first step is next."""

    def on_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Scalar metrics at an optimizer step (training at log steps, eval after evaluations)."""

    def on_text(self, key: str, text: str, step: int) -> None:
        """A text, e.g. one generation from an eval prompt."""

    def on_checkpoint(self, path: str) -> None:
        """A checkpoint became complete (visible under its final name)."""

    def on_end(self, status: str, final_dir: str | None, error: str | None = None) -> None:
        """The run ended: ``completed`` (with its export in ``final_dir``), ``stopped`` or ``failed``
        (``error``: what ended it, in one line)."""


class Callbacks(Callback):
    """Calls each callback in turn."""

    def __init__(self, callbacks=()):
        self.callbacks = list(callbacks)

    def before_resume(self, save_folder):
        for c in self.callbacks:
            c.before_resume(save_folder)

    def resume_decided(self, save_folder, resume, overwrite):
        for c in self.callbacks:
            c.resume_decided(save_folder, resume, overwrite)

    def on_start(self, info):
        for c in self.callbacks:
            c.on_start(info)

    def on_metrics(self, metrics, step):
        for c in self.callbacks:
            c.on_metrics(metrics, step)

    def on_text(self, key, text, step):
        for c in self.callbacks:
            c.on_text(key, text, step)

    def on_checkpoint(self, path):
        for c in self.callbacks:
            c.on_checkpoint(path)

    def on_end(self, status, final_dir, error=None):
        for c in self.callbacks:
            c.on_end(status, final_dir, error)
