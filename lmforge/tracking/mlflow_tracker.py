"""MLflow tracking through ``MlflowClient``.

No global active run: several runs may share a process (tests, sweeps).

Default store: ``sqlite:///$LMFORGE_HOME/mlflow/mlflow.db`` with artifacts
under ``$LMFORGE_HOME/mlflow/artifacts``, so ``mlflow ui --backend-store-uri
...`` shows every local run. mlflow is imported lazily: it takes seconds.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from lmforge.home import lmforge_home
from lmforge.config.tracking import MLflowConfig, TrackerConfig
from lmforge.errors import UserError
from lmforge.tracking.base import Tracker, flatten_params, one_line, scalar_metrics
from lmforge.secrets import redact

DEFAULT_EXPERIMENT = "lmforge"
# MLflow limits (mlflow.utils.validation); copied so the module imports without mlflow.
MAX_PARAM_VALUE = 6000
MAX_KEY = 250
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
STATUS = {"completed": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


def default_tracking_uri() -> str:
    return f"sqlite:///{Path(lmforge_home()) / 'mlflow' / 'mlflow.db'}"


def resolve_tracking_uri(cfg: MLflowConfig) -> str:
    return cfg.tracking_uri or default_tracking_uri()


def _local_store_dir(uri: str) -> Path | None:
    """The folder holding a local sqlite/file store (artifacts go beside it), else None."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).parent
    if uri.startswith("file://"):
        return Path(uri[len("file://"):])
    if "://" not in uri:  # a bare path is a file store
        return Path(uri)
    return None


def mlflow_ui_command(cfg: TrackerConfig) -> str | None:
    """The command that shows local runs in the MLflow UI; None when MLflow is off or remote."""
    if cfg.mlflow is None:
        return None
    uri = resolve_tracking_uri(cfg.mlflow)
    if _local_store_dir(uri) is None:
        return None  # a tracking server is its own UI
    return redact(f"mlflow ui --backend-store-uri {uri}")


def metric_key(name: str) -> str:
    """MLflow names allow alphanumerics, _ - . space and /; anything else becomes "_"."""
    key = re.sub(r"[^\w./\- ]", "_", name)
    key = re.sub(r"/+", "/", key).strip("/")  # "a//b" or "/a" would not round-trip as paths
    return key[:MAX_KEY] or "_"


def _param_value(value: Any) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_VALUE else text[: MAX_PARAM_VALUE - 3] + "..."


class MlflowTracker(Tracker):
    """One MLflow run; ``run_id`` given means continue that run (resume)."""

    name = "mlflow"

    def __init__(self, cfg: MLflowConfig, run_name: str, run_id: str | None = None,
                 tags: dict[str, str] | None = None) -> None:
        self.tracking_uri = resolve_tracking_uri(cfg)
        if self.tracking_uri.startswith(("http://", "https://")):
            # Fail in seconds, not minutes, when the server does not answer; a user's own
            # settings win.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        store_dir = _local_store_dir(self.tracking_uri)
        if store_dir is not None:
            store_dir.mkdir(parents=True, exist_ok=True)
        # The sqlite store logs its schema migrations at INFO on first use.
        for name in ("mlflow.store.db.utils", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)

        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        experiment_name = cfg.experiment_path or DEFAULT_EXPERIMENT
        self.experiment_id = self._experiment(experiment_name, store_dir)
        self.registry_name = cfg.model_registry_path
        if self.registry_name:
            self._check_registry()
        self.run_id = self._continue(run_id) if run_id else None
        if self.run_id is None:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
            self.run_id = run.info.run_id

    def _check_registry(self) -> None:
        """Create the registered model now, so a name the registry refuses stops the run before
        it trains (bad input) rather than after (a warning)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.registry_name)
            return
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                self._refuse(e)
                raise
        try:
            self.client.create_registered_model(self.registry_name, description="models trained with lmforge")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":  # another run registered it meanwhile
                self._refuse(e)
                raise

    def _refuse(self, e) -> None:
        if e.error_code == "INVALID_PARAMETER_VALUE":
            first = (str(e.message).strip().splitlines() or [""])[0]
            raise UserError(f"experiment_tracker.mlflow.model_registry_path {self.registry_name!r}: the MLflow "
                            f"registry at {self.tracking_uri} rejects it ({first})") from None

    def _experiment(self, name: str, store_dir: Path | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        # Without an explicit location a local store puts artifacts in ./mlruns of the cwd.
        location = None
        if store_dir is not None:
            location = (store_dir / "artifacts").resolve().as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def _continue(self, run_id: str) -> str | None:
        """Reopen a stored run if it still exists in this store and experiment."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException:
            return None
        if run.info.experiment_id != self.experiment_id or run.info.lifecycle_stage == "deleted":
            return None
        if run.info.status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
        return run_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        flat = {metric_key(k): _param_value(v) for k, v in flatten_params(params).items()}
        # MLflow refuses to change a logged param; a resumed run keeps its first values.
        existing = self.client.get_run(self.run_id).data.params
        items = [Param(k, v) for k, v in flat.items() if k not in existing]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i: i + PARAMS_PER_BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric_key(k), v, now, int(step))
                 for k, v in scalar_metrics(metrics).items()]
        for i in range(0, len(items), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i: i + METRICS_PER_BATCH])

    def log_text(self, key: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{metric_key(key)}/step_{int(step):06d}.txt")

    def log_model(self, final_dir: str) -> None:
        """Register the final model as a new version of ``model_registry_path`` (if set).

        The run has already finished well: a failure is one warning line, and the tracker goes on
        (``finish`` still marks the run)."""
        if not self.registry_name:
            return
        try:
            with warnings.catch_warnings():  # MLflow's advice on defining a PythonModel, for notebook users
                warnings.simplefilter("ignore")
                from lmforge.tracking.mlflow_model import register_model

            version = register_model(self.client, self.run_id, final_dir, self.registry_name)
        except Exception as exc:  # noqa: BLE001 - never fail a finished run over its registration
            print(f"warning: MLflow model registry: could not register {final_dir} as {self.registry_name!r} "
                  f"({one_line(exc)}); the run itself is complete", file=sys.stderr, flush=True)
            return
        print(f"MLflow model registry: {self.registry_name} version {version} "
              f"(mlflow.pyfunc.load_model('models:/{self.registry_name}/{version}'))", flush=True)

    def finish(self, status: str = "completed", error: str | None = None) -> None:
        if error:  # why a failed run ended, next to its status in the MLflow UI
            self.client.set_tag(self.run_id, "lmforge.error", error[:5000])
        self.client.set_terminated(self.run_id, status=STATUS.get(status, "FINISHED"))
