"""The final model as an MLflow pyfunc model, registered in the MLflow model registry.

The registered model holds the exported ``final/`` folder (weights, ``lmforge-model.json`` and
the tokenizer) as an artifact, lmforge's own source (``code/lmforge``: the serving side needs no
lmforge install, and runs the code the model was trained with) and pinned requirements. It
loads back with ``mlflow.pyfunc.load_model("models:/NAME/VERSION")`` — or serves with
``mlflow models serve -m models:/NAME/VERSION`` — and its ``predict`` takes prompts (a
``prompt`` column, a list or one string) and returns the prompts with their completions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import warnings
from importlib import metadata

import mlflow.pyfunc
import pandas as pd  # (an MLflow dependency) the type of `predict`'s input, which MLflow reads

# What the serving side imports (see LmforgeTextGenerator.load_context).
REQUIREMENTS = ("torch", "numpy", "pydantic", "tokenizers", "safetensors")
DEFAULT_PARAMS = {"max_new_tokens": 64, "temperature": 1.0, "top_k": 50, "top_p": 0.95, "seed": 0}


class LmforgeTextGenerator(mlflow.pyfunc.PythonModel):
    """Text generation with an lmforge model (pickled by reference: the class lives in the
    bundled ``code/lmforge``)."""

    def load_context(self, context) -> None:
        from lmforge.data.text.tokenizer import load_tokenizer
        from lmforge.resolve.weights import check_tokenizer_fits
        from lmforge.train.locate import load_model

        folder = context.artifacts["model"]
        self.model, cfg, _ = load_model(folder)
        self.model.eval()
        self.tokenizer = load_tokenizer(folder)
        check_tokenizer_fits(self.tokenizer, cfg, f"model {folder}")

    # Typed, so that MLflow does not warn at every import that it cannot infer a signature: a
    # DataFrame is an input type from which it infers none, so the signature given when the model is
    # saved (a `prompt` column, and `params`) stays the one checked and served.
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> list[str]:
        from lmforge.models.generate import generate

        p = DEFAULT_PARAMS | (params or {})
        tok = self.tokenizer
        out = []
        for i, prompt in enumerate(_prompts(model_input)):
            new = generate(self.model, tok.encode_prompt(prompt), int(p["max_new_tokens"]),
                           temperature=float(p["temperature"]), top_k=int(p["top_k"]) or None,
                           top_p=float(p["top_p"]), eos_id=tok.eos_id, seed=int(p["seed"]) + i)
            if new and new[-1] == tok.eos_id:
                new = new[:-1]
            out.append(prompt + tok.decode(new))
        return out


def _prompts(model_input) -> list[str]:
    if isinstance(model_input, str):
        return [model_input]
    if hasattr(model_input, "columns"):  # a pandas DataFrame (what a signature-checked call gets)
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        return [str(x) for x in model_input[column].tolist()]
    if isinstance(model_input, dict):
        value = model_input.get("prompt", next(iter(model_input.values()), []))
        return [value] if isinstance(value, str) else [str(x) for x in value]
    return [str(x) for x in model_input]


def _signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    kinds = {int: "long", float: "double"}
    params = ParamSchema([ParamSpec(k, kinds[type(v)], v) for k, v in DEFAULT_PARAMS.items()])
    return ModelSignature(inputs=Schema([ColSpec("string", "prompt")]), outputs=Schema([ColSpec("string")]),
                          params=params)


def _pinned(name: str) -> str:
    try:
        version = metadata.version(name).split("+")[0]  # torch 2.x+cpu: the local tag is not on PyPI
    except metadata.PackageNotFoundError:
        return name
    return f"{name}=={version}"


def register_model(client, run_id: str, final_dir: str, name: str) -> str:
    """Log ``final_dir`` as a pyfunc model under the run's ``model`` artifacts and register it as a
    new version of ``name``; returns the version."""
    import lmforge

    package = os.path.dirname(os.path.abspath(lmforge.__file__))
    with _quiet(), tempfile.TemporaryDirectory(prefix="lmforge-mlflow-") as tmp:
        code = os.path.join(tmp, "code", "lmforge")
        shutil.copytree(package, code, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        path = os.path.join(tmp, "model")
        mlflow.pyfunc.save_model(
            path, python_model=LmforgeTextGenerator(), artifacts={"model": os.path.abspath(final_dir)},
            code_paths=[code], pip_requirements=[_pinned(r) for r in REQUIREMENTS], signature=_signature(),
            metadata={"lmforge_version": lmforge.__version__, "task": "text-generation"})
        client.log_artifacts(run_id, path, "model")
        source = f"{client.get_run(run_id).info.artifact_uri}/model"
        version = client.create_model_version(name, source, run_id=run_id,
                                              description=f"lmforge final model of run {run_id}")
    return str(version.version)


@contextlib.contextmanager
def _quiet():
    """MLflow's advice to notebook users (type hints, input examples, pickling), its progress bars
    and its "waiting for the version" note would land in the training log; lmforge prints one line."""
    loggers = [logging.getLogger(n) for n in ("mlflow.pyfunc", "mlflow.models", "mlflow.store.model_registry")]
    levels = [lg.level for lg in loggers]
    old_bar = os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if old_bar is None:
            os.environ.pop("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", None)
        else:
            os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = old_bar
