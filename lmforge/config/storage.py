"""The `object_store:` and `secrets:` sections of a run config.

Neither ever holds a secret value: `secrets:` names a file or environment variables where the
keys live, so the resolved config (run.json, tracker params, --dry-run) can be shown as is.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ObjectStoreConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (R2, MinIO, SeaweedFS, ...); default: $AWS_ENDPOINT_URL or AWS")
    region: str | None = Field(None, description="S3 region; default: $AWS_REGION / the profile's")
    upload_retries: int = Field(5, ge=0, description="retries (exponential backoff) per file before an upload fails")
    upload_backoff_s: float = Field(0.5, gt=0, description="first retry delay; doubles on each retry")


class SecretsConfig(BaseModel):
    """Where credentials come from, besides the backend's own env/profile mechanisms."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str | None = Field(
        None, description="YAML/JSON/KEY=VALUE file with access_key_id, secret_access_key, session_token, "
        "endpoint_url, region, google_application_credentials")
    access_key_id_env: str | None = Field(None, description="env var holding the S3 access key id")
    secret_access_key_env: str | None = Field(None, description="env var holding the S3 secret access key")
    session_token_env: str | None = Field(None, description="env var holding an S3 session token")
    endpoint_url_env: str | None = Field(None, description="env var holding the S3 endpoint URL")
    profile: str | None = Field(None, description="AWS profile name (~/.aws/credentials)")

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, v):
        # `secrets: path/to/file` is short for `secrets: {file: path/to/file}`.
        if isinstance(v, str):
            return {"file": v}
        if isinstance(v, dict):
            inline = sorted(k for k in v if k in ("access_key_id", "secret_access_key", "session_token",
                                                   "aws_access_key_id", "aws_secret_access_key"))
            if inline:
                raise ValueError(f"{inline[0]}: never put keys in the config (it is written to run.json and "
                                 "trackers); put them in a file (secrets.file) or name env vars (secrets.*_env)")
        return v
