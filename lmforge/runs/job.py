"""One training job in this process: what a supervised child and each torchrun rank runs.

It wires the operations around the core trainer — credentials, the process group, the
trackers and the object-store mirror of a remote save folder — and runs it:

    secrets → process group → setup (data, plan) → Trainer(callbacks=[trackers, store]) → fit

`lmforge train` and `lmforge finetune` (and so the SDK) all end up here.
"""

from __future__ import annotations

from lmforge import secrets
from lmforge.config.identity import with_default_names
from lmforge.config.schema import RunConfig
from lmforge.distributed.dist import destroy, init_distributed
from lmforge.runs.store import MirrorCallback, local_folder, open_store
from lmforge.tracking import TrackingCallback, mlflow_ui_command
from lmforge.train.setup import setup_run
from lmforge.train.trainer import Trainer, TrainResult


def run_job(cfg: RunConfig, *, overwrite: bool = False, log=print) -> TrainResult:
    """Train (pretraining, continued pretraining or fine-tuning, by ``cfg.task_type``) here."""
    secrets.apply(cfg)  # credentials named by `secrets:` → this process's environment
    log = secrets.redacting(log)
    dist = init_distributed(cfg.compute.device)
    try:
        cfg = with_default_names(cfg)
        silent = lambda *_: None  # noqa: E731 - other ranks print nothing
        setup = setup_run(cfg, dist, log if dist.is_main else silent)
        callbacks = []
        if dist.is_main:
            callbacks.append(TrackingCallback(cfg.experiment_tracker))
            store = open_store(cfg, log)  # None for a local save_folder
            if store is not None:
                callbacks.append(MirrorCallback(store))
        trainer = Trainer(setup, dist, save_folder=local_folder(cfg.save_folder), callbacks=callbacks,
                          overwrite=overwrite, log=log)
        result = trainer.fit()
    finally:
        destroy()
    result.mlflow_ui = mlflow_ui_command(cfg.experiment_tracker)
    return result
