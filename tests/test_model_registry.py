"""The final model in model registries: the session's real `mlflow server` on loopback (sqlite backend,
local artifact root) and W&B offline files.

The two registered versions and the W&B artifact come from conftest's `finished_runs` (trained once
for this file and the report's); this file trains only the run whose registration must fail.
"""

from __future__ import annotations

import json

import pytest

from conftest import REGISTERED_MODEL, tiny_run_config
from train_helpers import assert_one_line_error, cli, write_config


@pytest.mark.e2e
def test_each_run_registers_a_new_version_that_loads_back_for_serving(finished_runs, mlflow_server, monkeypatch):
    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    from lmforge.data.text.tokenizer import load_tokenizer
    from lmforge.models.generate import generate
    from lmforge.train.locate import load_model

    name = REGISTERED_MODEL
    for i, run in enumerate(finished_runs):
        assert f"MLflow model registry: {name} version {i + 1}" in run.out
        # lmforge's own warnings (a tracker switched off, a failed registration) start with "warning:"
        assert not [ln for ln in run.err.splitlines() if ln.startswith("warning:")], run.err
    client = MlflowClient(tracking_uri=mlflow_server.url)
    versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    run_ids = [json.loads((r.folder / "trackers.json").read_text())["mlflow"]["run_id"] for r in finished_runs]
    assert [(v.version, v.run_id, v.status) for v in versions] == [("1", run_ids[0], "READY"), ("2", run_ids[1], "READY")]
    assert all(client.get_run(r).info.status == "FINISHED" for r in run_ids)
    # The registered model carries the weights with their tokenizer and lmforge's own code.
    files = {f.path for f in client.list_artifacts(run_ids[1], "model")}
    assert {"model/MLmodel", "model/code", "model/artifacts"} <= files
    weights = {f.path for f in client.list_artifacts(run_ids[1], "model/artifacts/final")}
    assert {"model/artifacts/final/model.safetensors", "model/artifacts/final/tokenizer.json"} <= weights

    # Loaded back through the registry, it generates exactly what the run's own export does.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    mlflow.set_tracking_uri(mlflow_server.url)
    served = mlflow.pyfunc.load_model(f"models:/{name}/2")
    prompts = ["def main(", "class "]
    got = served.predict(pd.DataFrame({"prompt": prompts}), params={"max_new_tokens": 12, "temperature": 0.0})
    final = finished_runs[1].folder / "final"
    model, _, _ = load_model(str(final))
    tok = load_tokenizer(str(final))
    for prompt, text in zip(prompts, got):
        new = generate(model, tok.encode(prompt), 12, temperature=0.0, eos_id=tok.eos_id)
        new = new[:-1] if new and new[-1] == tok.eos_id else new
        assert text == prompt + tok.decode(new)
        assert len(text) > len(prompt)


@pytest.mark.e2e
def test_a_registry_name_mlflow_rejects_is_one_line_exit_2(mlflow_server, tmp_path, tiny_data):
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_name
    from pydantic import ValidationError

    from lmforge.config.tracking import MLflowConfig
    from lmforge.errors import UserError
    from lmforge.tracking.mlflow_tracker import MlflowTracker

    # The config check is MLflow's own rule: it refuses exactly what MLflow refuses.
    for candidate in ["team/model", "a:b", "", "  ", "./m", "m/..", "..", ".", "team.project.model", "my model"]:
        try:
            _validate_model_name(candidate)
            mlflow_ok = True
        except MlflowException:
            mlflow_ok = False
        try:
            MLflowConfig(model_registry_path=candidate)
            ours_ok = True
        except ValidationError:
            ours_ok = False
        assert ours_ok == mlflow_ok, candidate
    # The command line (in this process; --dry-run so that a config let through would only print its plan).
    cfg = write_config(tmp_path / "bad.yaml", tiny_run_config(tiny_data, tmp_path / "bad"))
    assert_one_line_error(cli("train", "-f", cfg, "--dry-run",
                              "--set", "experiment_tracker.mlflow.model_registry_path=team/model"),
                          "experiment_tracker.mlflow.model_registry_path", "'/'")
    assert not (tmp_path / "bad").exists()  # nothing started
    # The registry server's own verdict, before any training (a config built past the check above).
    unchecked = MLflowConfig.model_construct(tracking_uri=mlflow_server.url, experiment_path=None,
                                             model_registry_path="team/model")
    with pytest.raises(UserError, match=r"model_registry_path 'team/model': the MLflow registry at .* rejects it"):
        MlflowTracker(unchecked, "rejected")


@pytest.mark.e2e
def test_a_registry_failure_at_the_end_is_a_warning_and_the_run_completes(mlflow_server, tmp_path, tiny_data,
                                                                          capfd):
    from mlflow.tracking import MlflowClient

    from lmforge.config.load import build_config
    from lmforge.runs.job import run_job

    # An experiment of the real server whose artifact store (FTP, on a port where nothing listens) is
    # unreachable: the run's metrics go to the server, registering the final model needs the artifact
    # store. No eval prompts, so no generation text is uploaded there before the end.
    client = MlflowClient(mlflow_server.url)
    client.create_experiment("unreachable-artifacts", artifact_location="ftp://127.0.0.1:9/artifacts")
    folder = tmp_path / "run"
    cfg = tiny_run_config(tiny_data, folder, training_duration="2ba", **{
        "eval.interval": "2ba", "save_interval": "2ba", "eval.prompts": [], "experiment_tracker.console": False,
        "experiment_tracker.mlflow": {"tracking_uri": mlflow_server.url, "experiment_path": "unreachable-artifacts",
                                      "model_registry_path": "never-registered"}})
    result = run_job(build_config(cfg), log=lambda *a: None)
    assert result.status == "completed" and (folder / "final" / "model.safetensors").exists()
    err = capfd.readouterr().err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning: MLflow model registry")]
    assert len(warnings) == 1 and "'never-registered'" in warnings[0] and "the run itself is complete" in warnings[0]
    assert "tracking disabled" not in err  # the tracker went on and closed its run
    run_id = json.loads((folder / "trackers.json").read_text())["mlflow"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.search_model_versions("name='never-registered'") == []


@pytest.mark.e2e
def test_wandb_logs_the_final_model_as_an_artifact(finished_runs):
    from test_tracking import _wandb_records
    from wandb.proto import wandb_internal_pb2 as pb

    run = finished_runs[1]  # the run that also logs to W&B (offline)
    (records,) = [_wandb_records(f) for f in (run.folder / "wandb").glob("offline-run-*/run-*.wandb")]
    artifacts = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "artifact" and rec.artifact.type == "model":  # (tables are artifacts too)
            artifacts.append(rec.artifact)
    (art,) = artifacts
    assert art.type == "model" and art.name == "report-slow-model" and "final" in art.aliases
    contents = {c.path: c.size for c in art.manifest.contents}
    final = run.folder / "final"
    assert contents == {p.name: p.stat().st_size for p in final.iterdir() if p.is_file()}
    assert {"model.safetensors", "tokenizer.json", "lmforge-model.json"} <= set(contents)


@pytest.mark.e2e
def test_the_pyfunc_model_class_is_defined_without_mlflow_warnings():
    """MLflow checks a PythonModel's `predict` when the class is defined (every run that registers a
    model imports it): no "Add type hints" warning, in a fresh interpreter that shows every warning."""
    import subprocess
    import sys

    from train_helpers import REPO, env

    proc = subprocess.run([sys.executable, "-W", "always", "-c", "import lmforge.tracking.mlflow_model"],
                          capture_output=True, text=True, env=env(), cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "type hint" not in proc.stderr.lower(), proc.stderr[-2000:]
