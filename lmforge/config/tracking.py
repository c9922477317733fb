"""The `experiment_tracker:` section of a run config."""

from __future__ import annotations

import posixpath

from pydantic import BaseModel, ConfigDict, Field, field_validator


class MLflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    experiment_path: str | None = Field(
        None, description="MLflow experiment name; default 'lmforge'")
    tracking_uri: str | None = Field(
        None, description="MLflow server or store; default sqlite:///$LMFORGE_HOME/mlflow/mlflow.db")
    model_registry_path: str | None = Field(
        None, description="register the final model (with its tokenizer) under this name in the MLflow model "
        "registry, a new version per run; load it with mlflow.pyfunc.load_model('models:/NAME/VERSION')")

    @field_validator("model_registry_path")
    @classmethod
    def _registry_name(cls, v):
        # MLflow's own rule for registered model names (mlflow.utils.validation._validate_model_name),
        # repeated here so that validating a config does not import mlflow (seconds); the store's
        # verdict is checked again when the run starts.
        if v is None:
            return v
        if not v.strip():
            raise ValueError("expected a registered model name, got an empty one")
        if "/" in v or ":" in v:
            raise ValueError("MLflow model names cannot contain '/' or ':' (use e.g. team.project.model)")
        norm = posixpath.normpath(v)
        if norm != v or norm == "." or norm.startswith(".."):
            raise ValueError(f"MLflow rejects names that resolve to another path ({norm!r})")
        return v


class WandbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str = Field("lmforge", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user")
    mode: str | None = Field(None, description="online | offline | disabled; default: $WANDB_MODE or online")


class TrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    mlflow: MLflowConfig | None = Field(
        default_factory=MLflowConfig, description="MLflow tracking; null to turn off")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases tracking; off unless set")
    jsonl: bool = Field(True, description="write metrics.jsonl in the run folder")
    report: bool = Field(True, description="write report.html (curves, evals, samples, plan vs actual) in the run "
                         "folder at each eval and at the end")
    console: bool = Field(True, description="progress bar / log lines on the terminal")
