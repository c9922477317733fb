"""The `experiment_tracker:` section of a run config."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MLflowConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    experiment_path: str | None = Field(
        None, description="MLflow experiment name; default 'lmforge'")
    tracking_uri: str | None = Field(
        None, description="MLflow server or store; default sqlite:///$LMFORGE_HOME/mlflow/mlflow.db")


class WandbConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str = Field("lmforge", description="W&B project")
    entity: str | None = Field(None, description="W&B team or user")
    mode: str | None = Field(None, description="online | offline | disabled; default: $WANDB_MODE or online")


class TrackerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mlflow: MLflowConfig | None = Field(
        default_factory=MLflowConfig, description="MLflow tracking; null to turn off")
    wandb: WandbConfig | None = Field(None, description="Weights & Biases tracking; off unless set")
    jsonl: bool = Field(True, description="write metrics.jsonl in the run folder")
    console: bool = Field(True, description="progress bar / log lines on the terminal")
