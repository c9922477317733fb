"""A remote save_folder on a real S3 server (SeaweedFS on loopback): upload, resume, credentials, secrets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_run_config
from lmforge.data import remote
from s3server import S3Server, weed_binary
from train_helpers import (REPO, assert_one_line_error, cli, communicate, env, final_weights, lmforge, metrics,
                           write_config)


def _s3fs(server):
    import s3fs

    return s3fs.S3FileSystem(key=server.key, secret=server.secret, skip_instance_cache=True,
                             client_kwargs={"endpoint_url": server.endpoint_url, "region_name": "us-east-1"})


def _staging(home: Path, uri: str) -> Path:
    """The staging folder a run in LMFORGE_HOME=home uses for save_folder uri (computed as lmforge does)."""
    code = f"from lmforge.runs.store import staging_dir; print(staging_dir({uri!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env(LMFORGE_HOME=str(home)))
    return Path(out.stdout.strip())


def _start(cfg, home, **extra):
    return subprocess.Popen([sys.executable, "-m", "lmforge", "train", "-f", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(LMFORGE_HOME=str(home), **extra), cwd=REPO)


def _run(cfg, home, *args, **extra):
    return subprocess.run([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), *args], capture_output=True,
                          text=True, env=env(LMFORGE_HOME=str(home), **extra), cwd=REPO, timeout=300)


def _wait_for(pred, proc, timeout=180, what=""):
    deadline = time.time() + timeout
    while not pred():
        assert proc is None or proc.poll() is None, f"process ended before {what}: {proc.communicate()}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _complete_steps(fs, prefix: str) -> list[int]:
    fs.invalidate_cache()
    found = fs.glob(f"{prefix}/checkpoints/step_*/lmforge-complete.json")
    return sorted(int(p.split("/")[-2].split("_")[1]) for p in found)


COMMON = {"training_duration": "40ba", "save_interval": "4ba", "eval.interval": "100ba", "eval.prompts": [],
          "parameters.learning_rate": 3e-3}


@pytest.mark.e2e
def test_train_to_s3_lose_the_machine_resume_from_the_store(s3_env, tmp_path, tiny_data):
    """Kill the trainer once a checkpoint is in the store, delete everything local, re-run on a
    'fresh machine': it downloads the latest complete checkpoint and ends with exactly the
    uninterrupted run's weights. A marker-less remote checkpoint is ignored with a warning."""
    ref_cfg = write_config(tmp_path / "ref.yaml", tiny_run_config(tiny_data, tmp_path / "ref", **COMMON))
    lmforge("train", "-f", ref_cfg, check=True)

    uri = f"s3://{s3_env.bucket}/runs/lost-machine"
    prefix = uri[len("s3://"):]
    fs = _s3fs(s3_env)
    cfg = write_config(tmp_path / "s3.yaml", tiny_run_config(tiny_data, uri, **COMMON))
    home1 = tmp_path / "machine1"
    proc = _start(cfg, home1, LMFORGE_TEST_HANG="0:12")  # held after step 12: it cannot finish before the kill
    _wait_for(lambda: _complete_steps(fs, prefix), proc, what="a checkpoint in the store")
    proc.kill()
    proc.communicate()
    stage1 = _staging(home1, uri)
    assert stage1.is_dir() and max(r["step"] for r in metrics(stage1)) < 40, "the run ended before the kill"
    fs.invalidate_cache()
    assert not fs.exists(f"{prefix}/final/model.safetensors")
    # An interrupted upload of a later checkpoint: files but no completion marker.
    fs.pipe_file(f"{prefix}/checkpoints/step_00000039/lmforge-state.json", b"{}")

    home2 = tmp_path / "machine2"  # nothing local: another machine, or the same one wiped
    import shutil

    shutil.rmtree(home1)
    proc2 = _run(cfg, home2)
    assert proc2.returncode == 0, proc2.stderr[-3000:]
    assert "step_00000039 has no completion marker" in proc2.stdout, proc2.stdout
    assert "resume: downloaded" in proc2.stdout and "sizes verified" in proc2.stdout
    assert "resume: continuing from" in proc2.stdout
    assert f"final model: {uri}/final" in proc2.stdout  # the store's copy, not the staging folder
    fs.invalidate_cache()  # the supervisor copied the run's log to the store after the resumption
    assert "resume: downloaded" in fs.cat_file(f"{prefix}/logs/resumption-0.log").decode()

    local = tmp_path / "got.safetensors"
    fs.get_file(f"{prefix}/final/model.safetensors", str(local))
    ref, got = final_weights(tmp_path / "ref"), load_file(str(local))
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), f"{k} differs after resuming from the store"
    # keep-N applies remotely (the marker-less leftover is older than the newest: pruned too). Step 36
    # is usually the other one kept, unless its upload was superseded by step 40's while it waited.
    steps = _complete_steps(fs, prefix)
    assert steps[-1] == 40 and len(steps) == 2, steps
    fs.invalidate_cache()
    left = {p.split("/")[-2] for p in fs.find(f"{prefix}/checkpoints")}  # objects (S3 has no real folders)
    assert left == {f"step_{s:08d}" for s in steps}, sorted(fs.find(f"{prefix}/checkpoints"))
    assert fs.exists(f"{prefix}/run.json") and fs.exists(f"{prefix}/metrics.jsonl")
    rows = [json.loads(x) for x in fs.cat_file(f"{prefix}/metrics.jsonl").decode().splitlines()]
    assert max(r["step"] for r in rows) == 40
    # [report] The store holds the run's report too, and `lmforge report` reads the remote folder itself:
    # the lost machine's part of the run and the resumed one are both on its timeline.
    assert fs.exists(f"{prefix}/report.html") and fs.exists(f"{prefix}/plan.json")
    page = tmp_path / "remote-report.html"
    assert cli("report", uri, "--out", page).returncode == 0  # in this process: no start-up
    assert "resumption 1: COMPLETED" in page.read_text()
    from lmforge.report import load_run
    from lmforge.runs.registry import RegistryIndex

    assert [r["status"] for r in load_run(uri, index=RegistryIndex()).resumptions] == ["FAILED", "COMPLETED"]

    # run.json identity is checked against the store: another run may not reuse the folder
    other = write_config(tmp_path / "other.yaml", tiny_run_config(tiny_data, uri, name="other", **COMMON))
    clash = _run(other, tmp_path / "machine3")
    assert_one_line_error(clash, "holds checkpoints of a different run", "'tiny-")
    # --overwrite never replaces a run of another name (issue 59), in a store too ...
    assert_one_line_error(_run(other, tmp_path / "machine3", "--overwrite"), "holds run 'tiny-",
                          "--overwrite replaces only a run of the same name")
    # ... but does replace the store's run of the same name with another model (nothing of the old is left)
    short_cfg = tiny_run_config(tiny_data, uri, **COMMON | {"training_duration": "4ba", "save_interval": "2ba"})
    short_cfg["model"]["d_model"] = 32
    short = write_config(tmp_path / "short.yaml", short_cfg)
    proc3 = _run(short, tmp_path / "machine3", "--overwrite")
    assert proc3.returncode == 0, proc3.stderr[-3000:]
    # Step 2's upload may be skipped (superseded by step 4 while it waited): either way none of the old is left.
    steps = _complete_steps(fs, prefix)
    assert steps[-1] == 4 and set(steps) <= {2, 4}, steps
    assert json.loads(fs.cat_file(f"{prefix}/run.json"))["identity"]["model"]["d_model"] == 32
    rows = [json.loads(x) for x in fs.cat_file(f"{prefix}/metrics.jsonl").decode().splitlines()]
    assert max(r["step"] for r in rows) == 4


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own, which the test stops and restarts."""
    if weed_binary() is None:
        pytest.skip("SeaweedFS `weed` binary is not installed")
    servers = [S3Server.start(tmp_path / "own-s3")]
    yield servers
    for s in servers:
        s.stop()


@pytest.mark.e2e
def test_server_stops_mid_upload_then_restarts_or_not(own_server, tmp_path, tiny_data):
    server = own_server[0]
    fs = _s3fs(server)
    extra = server.env
    cfg_common = COMMON | {"training_duration": "120ba", "save_interval": "10ba", "object_store.upload_retries": 6}

    # 1) down for a few seconds while training goes on, then back: every upload completes
    uri = f"s3://{server.bucket}/runs/flaky"
    home = tmp_path / "home"
    cfg = write_config(tmp_path / "flaky.yaml", tiny_run_config(tiny_data, uri, **cfg_common))
    stage = _staging(home, uri)
    proc = _start(cfg, home, **extra)
    _wait_for(lambda: max((r["step"] for r in metrics(stage)), default=0) >= 10, proc, what="step 10")
    server.stop()
    stopped_at = max(r["step"] for r in metrics(stage))
    # training does not wait for the store: it passes the next checkpoints while the store is down
    _wait_for(lambda: max(r["step"] for r in metrics(stage)) >= min(stopped_at + 25, 120), proc,
              what="training to go on while the store is down")
    own_server.append(S3Server.start(tmp_path / "own-s3", ports=server.ports))
    out, err = communicate(proc, 300)
    assert proc.returncode == 0, err[-3000:]
    assert "retrying" in out  # the outage was seen and retried
    assert _complete_steps(fs, uri[5:])[-1] == 120
    fs.invalidate_cache()
    assert fs.exists(f"{uri[5:]}/final/lmforge-complete.json")

    # 2) down for good: the run trains to the end, then fails with one line; the local copy is intact
    server = own_server[-1]
    uri2 = f"s3://{server.bucket}/runs/down"
    cfg2 = write_config(tmp_path / "down.yaml", tiny_run_config(  # 40 steps: the uploads of steps 20 to 40 fail
        tiny_data, uri2, **cfg_common | {"training_duration": "40ba", "object_store.upload_retries": 1,
                                         "object_store.upload_backoff_s": 0.1}))
    stage2 = _staging(home, uri2)
    proc = _start(cfg2, home, **extra)
    _wait_for(lambda: max((r["step"] for r in metrics(stage2)), default=0) >= 10, proc, what="step 10")
    server.stop()
    out, err = communicate(proc, 300)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert_one_line_error(done, f"upload to {uri2} failed", "re-run the same command")
    assert max(r["step"] for r in metrics(stage2)) == 40
    assert (stage2 / "final" / "model.safetensors").exists()
    assert (stage2 / "checkpoints" / "step_00000040" / "lmforge-state.json").exists()
    assert server.key not in err and server.secret not in out + err


@pytest.mark.e2e
def test_the_old_marker_check_rides_out_an_outage(own_server, tmp_path, monkeypatch):
    """Saving a step again re-uploads it: its old completion marker is looked for and deleted
    first, through the same retries as every upload call. A store that is down at that moment
    must neither fail the upload nor leave the old marker standing over the new files."""
    import threading

    import fsspec

    from lmforge.runs.store import MARKER, RunStore

    server = own_server[0]
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    logs: list[str] = []
    retried = threading.Event()

    def log(line: str) -> None:
        logs.append(line)
        if "retrying" in line:
            retried.set()

    store = RunStore(f"s3://{server.bucket}/runs/remark", str(tmp_path / "stage"), keep=2, retries=8,
                     backoff=0.25, log=log)
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "shard.bin").write_bytes(b"1" * 10)
    dest = store._p("checkpoints", "step_00000001")
    store._upload_folder(str(snap), dest, "checkpoints/step_00000001", 1)
    (snap / "shard.bin").write_bytes(b"2" * 20)  # the same step, saved again
    server.stop()

    def restart_after_a_retry():
        # The store comes back only once lmforge's own retry has seen it down (the S3 client's
        # internal retries would otherwise hide a short outage); the timeout keeps a failure finite.
        retried.wait(timeout=120)
        own_server.append(S3Server.start(tmp_path / "own-s3", ports=server.ports))

    restart = threading.Thread(target=restart_after_a_retry)
    restart.start()
    store._upload_folder(str(snap), dest, "checkpoints/step_00000001", 1)
    restart.join()
    assert any("looking for an old marker" in line and "retrying" in line for line in logs), logs
    fs = _s3fs(server)
    assert json.loads(fs.cat_file(f"{dest}/{MARKER}"))["files"] == {"shard.bin": 20}
    assert fs.cat_file(f"{dest}/shard.bin") == b"2" * 20


def _check(monkeypatch, *args, **env_vars):
    """`lmforge train ARGS` in this process with these AWS_* variables: the credentials check runs
    before any process starts. fsspec caches clients by their arguments, so start from none."""
    import fsspec

    for k, v in env_vars.items():
        monkeypatch.setenv(k, v)
    fsspec.get_filesystem_class("s3").clear_instance_cache()
    try:
        return cli("train", *args)
    finally:
        fsspec.get_filesystem_class("s3").clear_instance_cache()


@pytest.mark.e2e
def test_credentials_check(s3_env, tmp_path, tiny_data, monkeypatch):
    uri = f"s3://{s3_env.bucket}/runs/check"
    cfg = write_config(tmp_path / "c.yaml", tiny_run_config(tiny_data, uri))
    ok = _check(monkeypatch, "-f", cfg, "--check-credentials")
    assert ok.returncode == 0, ok.stderr
    assert f"write {uri}: ok" in ok.stdout and "credentials: ok" in ok.stdout
    _s3fs(s3_env).invalidate_cache()
    assert not _s3fs(s3_env).glob(f"{s3_env.bucket}/runs/check/.lmforge-write-check-*")  # probe deleted

    # wrong keys: fails at the check (before the trainer starts), naming the bucket, without showing the key
    with monkeypatch.context() as m:
        bad = _check(m, "-f", cfg, AWS_SECRET_ACCESS_KEY="wrong-secret-value")
    assert_one_line_error(bad, f"cannot write to {uri}", f"bucket {s3_env.bucket!r}", "access denied")
    assert "wrong-secret-value" not in bad.stdout + bad.stderr
    # skipping the check: the trainer's first access to the store fails just as clearly
    skipped = subprocess.run([sys.executable, "-m", "lmforge", "train", "-f", str(cfg), "--skip-credentials-check"],
                             capture_output=True, text=True, env=env(AWS_SECRET_ACCESS_KEY="wrong-secret-value"),
                             cwd=REPO, timeout=120)
    assert_one_line_error(skipped, uri, "access denied")
    assert "wrong-secret-value" not in skipped.stdout + skipped.stderr

    # keys that may read but not write: the data check passes, the save_folder check names the bucket
    from s3server import READ_KEY, READ_SECRET

    data_uri = f"s3://{s3_env.bucket}/datasets/ro"
    remote.upload_dir(str(tiny_data.dataset), data_uri)
    ro = write_config(tmp_path / "ro.yaml", tiny_run_config(tiny_data, uri, train_data=data_uri))
    with monkeypatch.context() as m:
        denied = _check(m, "-f", ro, "--check-credentials", AWS_ACCESS_KEY_ID=READ_KEY,
                        AWS_SECRET_ACCESS_KEY=READ_SECRET)
    assert f"read  {data_uri}: ok" in denied.stdout
    assert_one_line_error(denied, f"cannot write to {uri}", f"bucket {s3_env.bucket!r}", "access denied")

    # a missing bucket; remote data that is not there; an unknown scheme
    nob = write_config(tmp_path / "nob.yaml", tiny_run_config(tiny_data, "s3://no-such-bucket-zz/runs/x"))
    assert_one_line_error(_check(monkeypatch, "-f", nob, "--check-credentials"), "no-such-bucket-zz",
                          "bucket does not exist")
    nodata = write_config(tmp_path / "nodata.yaml", tiny_run_config(
        tiny_data, tmp_path / "x", train_data=f"s3://{s3_env.bucket}/no/such/data"))
    assert_one_line_error(_check(monkeypatch, "-f", nodata, "--check-credentials"),
                          f"s3://{s3_env.bucket}/no/such/data not found")
    scheme = write_config(tmp_path / "scheme.yaml", tiny_run_config(tiny_data, "foo://bucket/x"))
    assert_one_line_error(_check(monkeypatch, "-f", scheme, "--check-credentials"), "foo://bucket/x",
                          "cannot open this kind of URI")


@pytest.mark.e2e
def test_secrets_config_and_errors(tmp_path, tiny_data):
    inline = write_config(tmp_path / "inline.yaml", tiny_run_config(
        tiny_data, tmp_path / "r", secrets={"secret_access_key": "abc"}))
    assert_one_line_error(lmforge("train", "-f", inline, "--dry-run"), "secrets", "never put keys in the config")
    unset = write_config(tmp_path / "unset.yaml", tiny_run_config(
        tiny_data, tmp_path / "r", secrets={"secret_access_key_env": "LMFORGE_TEST_UNSET_VAR"}))
    assert_one_line_error(lmforge("train", "-f", unset, "--dry-run"), "LMFORGE_TEST_UNSET_VAR is not set")
    missing = write_config(tmp_path / "missing.yaml", tiny_run_config(tiny_data, tmp_path / "r",
                                                                      secrets=str(tmp_path / "nope.env")))
    assert_one_line_error(lmforge("train", "-f", missing, "--dry-run"), "secrets.file", "nope.env")
    (tmp_path / "bad.env").write_text("AWS_SECRET_ACCESS_KEY=s3cr3t-value\nPASSWORD=other-s3cr3t\n")
    bad = write_config(tmp_path / "bad.yaml", tiny_run_config(tiny_data, tmp_path / "r",
                                                              secrets=str(tmp_path / "bad.env")))
    proc = lmforge("train", "-f", bad, "--dry-run")
    assert_one_line_error(proc, "unknown key 'PASSWORD'")
    assert "s3cr3t" not in proc.stderr
    # An error the training process itself raises (and says before its teardown) is masked too.
    uri = write_config(tmp_path / "uri.yaml", tiny_run_config(tiny_data, tmp_path / "r",
                                                              train_data="foo://alice:hunter2pw@host/data.txt"))
    proc = lmforge("train", "-f", uri)
    assert_one_line_error(proc, "foo://***@host/data.txt")
    assert "hunter2pw" not in proc.stdout + proc.stderr

    from lmforge import secrets

    secrets._known.add("s3cr3t-value-1")
    assert secrets.redact("key s3cr3t-value-1 at https://u:pw@host/x") == "key *** at https://***@host/x"
    assert secrets.redact_config({"a": ["s3cr3t-value-1"], "n": 3}) == {"a": ["***"], "n": 3}
    # library log lines too (botocore, s3fs, mlflow log through `logging`)
    import logging

    secrets._redact_log_records()
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("lmforge.test.redaction")
    logger.addHandler(handler)
    logger.warning("signing with %s", "s3cr3t-value-1")
    logger.removeHandler(handler)
    assert records == ["signing with ***"]


@pytest.mark.e2e
def test_secret_key_appears_in_nothing_the_run_wrote(s3_server, tmp_path, tiny_data):
    """Credentials only through `secrets:` (a file); the secret key is then nowhere: logs, metrics,
    run.json, checkpoints' config, the staging folder, MLflow's params and sqlite store, the store."""
    s3_env = s3_server
    creds = tmp_path / "creds" / "s3.yaml"
    creds.parent.mkdir()
    creds.write_text(f"aws_access_key_id: {s3_env.key}\naws_secret_access_key: {s3_env.secret}\n"
                     f"endpoint_url: {s3_env.endpoint_url}\nregion: us-east-1\n")
    uri = f"s3://{s3_env.bucket}/runs/secret"
    data_uri = f"s3://{s3_env.bucket}/datasets/secret"  # the data is read from the store too
    _s3fs(s3_env).put(str(tiny_data.dataset), data_uri[5:], recursive=True)
    cfg = write_config(tmp_path / "s.yaml", tiny_run_config(
        tiny_data, uri, training_duration="4ba", save_interval="2ba", secrets=str(creds), train_data=data_uri,
        **{"experiment_tracker.mlflow": {}, "eval.interval": "2ba"}))
    home = tmp_path / "home"
    assert not any(k in os.environ for k in s3_env.env)  # the secrets file is the only source
    outputs = []
    for args in (["--dry-run"], ["--check-credentials"], ["--json"]):
        proc = _run(cfg, home, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append(proc.stdout + proc.stderr)
    assert f"read  {data_uri}: ok" in outputs[1] and f"write {uri}: ok" in outputs[1]
    secret = s3_env.secret.encode()
    assert all(s3_env.secret not in o for o in outputs)
    written = [p for p in home.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in written) and any(p.name == "run.json" for p in written)
    assert any(p.name == "lmforge-state.json" for p in written)
    for p in written:
        assert secret not in p.read_bytes(), p
    fs = _s3fs(s3_env)
    fs.invalidate_cache()
    objects = fs.find(uri[5:])
    assert any(o.endswith("final/model.safetensors") for o in objects)
    for o in objects:
        assert secret not in fs.cat_file(o), o
    run = json.loads(fs.cat_file(f"{uri[5:]}/run.json"))
    assert run["config"]["secrets"]["file"] == str(creds)  # where the keys are: shown; the keys: never
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{home}/mlflow/mlflow.db")
    (mlrun,) = client.search_runs([client.get_experiment_by_name("lmforge").experiment_id])
    assert mlrun.data.params["secrets.file"] == str(creds)
    assert all(s3_env.secret not in v for v in mlrun.data.params.values())
