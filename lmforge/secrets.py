"""Object-store credentials: where they come from, keeping them out of every output, checking them.

Credentials come from each backend's own mechanisms (``AWS_*`` variables, ``~/.aws`` profiles,
``GOOGLE_APPLICATION_CREDENTIALS``) plus the config's optional ``secrets:`` section, which names a
file or environment variables, never values. :func:`apply` puts what ``secrets:`` names into this
process's environment, where s3fs/gcsfs (and torchrun's ranks, and data workers) pick them up, and
remembers the values so that :func:`redact` can blank them out of anything shown or written.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid

from lmforge.config.load import read_text_file
from lmforge.errors import UserError

MASK = "***"

# Secret values seen in this process (from secrets: or the standard env vars); redact() hides them.
_known: set[str] = set()

# Environment variables whose values are secrets wherever they come from.
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

# secrets-file key (lowercase, optional "aws_" prefix) → environment variable it sets.
_FILE_KEYS = {
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "session_token": "AWS_SESSION_TOKEN",
    "endpoint_url": "AWS_ENDPOINT_URL_S3",
    "region": "AWS_REGION",
    "google_application_credentials": "GOOGLE_APPLICATION_CREDENTIALS",
}
_SECRET_VARS = {"AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}


def _read_file(path: str) -> dict[str, str]:
    """A YAML/JSON mapping, or ``KEY=VALUE`` lines (dotenv / ~/.aws/credentials style)."""
    path = os.path.expanduser(path)
    text = read_text_file(path, "secrets.file")
    data: dict = {}
    try:
        import yaml

        loaded = yaml.safe_load(text)
        if isinstance(loaded, dict):
            data = loaded
    except Exception:  # noqa: BLE001 - not YAML: try KEY=VALUE lines below
        pass
    if not data:
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "[")) and "=" in line:
                k, v = line.split("=", 1)
                data[k.strip().removeprefix("export ").strip()] = v.strip().strip("'\"")
    out = {}
    for k, v in data.items():
        key = str(k).lower().removeprefix("aws_")
        if key not in _FILE_KEYS:
            # Name the key, never the value (it may be a secret).
            raise UserError(f"secrets.file {path}: unknown key {k!r}; expected one of {', '.join(_FILE_KEYS)}")
        if v is not None:
            out[_FILE_KEYS[key]] = str(v)
    if "AWS_REGION" in out:
        out["AWS_DEFAULT_REGION"] = out["AWS_REGION"]
    return out


def resolve(cfg) -> dict[str, str]:
    """Environment variables the config's ``secrets:`` / ``object_store:`` sections ask for."""
    env: dict[str, str] = {}
    store = getattr(cfg, "object_store", None)
    if store is not None and store.endpoint_url:
        env["AWS_ENDPOINT_URL_S3"] = store.endpoint_url
    if store is not None and store.region:
        env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = store.region
    s = getattr(cfg, "secrets", None)
    if s is None:
        return env
    if s.file:
        env |= _read_file(s.file)
    for field, var in (("access_key_id_env", "AWS_ACCESS_KEY_ID"), ("secret_access_key_env", "AWS_SECRET_ACCESS_KEY"),
                       ("session_token_env", "AWS_SESSION_TOKEN"), ("endpoint_url_env", "AWS_ENDPOINT_URL_S3")):
        name = getattr(s, field)
        if name:
            if not os.environ.get(name):
                raise UserError(f"secrets.{field}: environment variable {name} is not set")
            env[var] = os.environ[name]
    if s.profile:
        env["AWS_PROFILE"] = s.profile
    return env


def apply(cfg) -> None:
    """Put the configured credentials into this process's environment; remember the secret values."""
    env = resolve(cfg)
    for var, value in env.items():
        if var in _SECRET_VARS:
            _known.add(value)
    os.environ.update(env)
    if "AWS_ENDPOINT_URL_S3" in env:
        os.environ.pop("AWS_ENDPOINT_URL", None)  # the config's endpoint wins over a generic one
    for var in SECRET_ENV:
        if os.environ.get(var):
            _known.add(os.environ[var])
    if env:
        _forget_cached_clients()
    _redact_log_records()


_factory_installed = False


def _redact_log_records() -> None:
    """Every ``logging`` record (botocore, s3fs, mlflow, ...) is redacted when it is created.

    A record factory sees the records of every logger and handler, including ones set up later,
    which a filter on today's handlers would not.
    """
    global _factory_installed
    if _factory_installed:
        return
    import logging

    make = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = make(*args, **kwargs)
        if _known:
            try:
                record.msg, record.args = redact(record.getMessage()), ()
            except Exception:  # noqa: BLE001 - a malformed record is logging's problem, not ours
                pass
        return record

    logging.setLogRecordFactory(factory)
    _factory_installed = True


def _forget_cached_clients() -> None:
    """fsspec caches filesystems by their arguments, not by credentials: start fresh after a change."""
    try:
        import fsspec

        fsspec.get_filesystem_class("s3").clear_instance_cache()
    except Exception:  # noqa: BLE001 - s3fs not installed: nothing cached
        pass


# Credentials a URI carries: its userinfo (``scheme://user:pass@``, ``https://TOKEN@``) and secret
# query parameters (``?token=``, a presigned URL's ``X-Amz-Signature=``).
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]+@")
_SECRET_QUERY = re.compile(r"([?&](?:[\w.-]*(?:password|passwd|pwd|token|secret|signature|credential|api[_-]?key|"
                           r"access[_-]?key)[\w.-]*)=)[^&#\s'\"]+", re.I)


def redact(text: str) -> str:
    """``text`` with every known secret value, and the credentials of every URI in it (its userinfo,
    secret query parameters), masked: the one redaction of whatever lmforge prints or stores."""
    text = str(text)
    for var in SECRET_ENV:  # values that arrived after apply() (e.g. set by a library)
        if os.environ.get(var):
            _known.add(os.environ[var])
    for value in sorted(_known, key=len, reverse=True):
        if len(value) >= 4:  # never mask trivial strings (they would garble everything)
            text = text.replace(value, MASK)
    return _SECRET_QUERY.sub(rf"\1{MASK}", _USERINFO.sub(rf"\1{MASK}@", text))


def redact_config(obj):
    """A copy of a JSON-like config with :func:`redact` applied to every string."""
    if isinstance(obj, dict):
        return {k: redact_config(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_config(v) for v in obj]
    return redact(obj) if isinstance(obj, str) else obj


def redacting(log):
    """Wrap a log function so that nothing it prints can show a secret."""
    return lambda *args, **kw: log(*(redact(a) if isinstance(a, str) else a for a in args), **kw)


# --- `lmforge train --check-credentials` -------------------------------------------------------

def _bucket(uri: str) -> str:
    return uri.split("://", 1)[1].split("/", 1)[0]


def _why(e: BaseException) -> str:
    if isinstance(e, PermissionError):
        return "access denied (wrong keys or no permission)"
    if isinstance(e, FileNotFoundError):
        return "not found"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return redact(f"{type(e).__name__}: {msg}"[:300])


def _bucket_exists(fs, bucket: str) -> bool:
    try:
        fs.info(bucket)  # HEAD on the bucket: unlike exists(), tells "missing" from "forbidden"
        return True
    except FileNotFoundError:
        return False
    except PermissionError:
        return True  # wrong keys, or no right to HEAD the bucket: the access itself will tell


def _access_points(cfg) -> tuple[list[str], list[str]]:
    """(URIs to read, URIs to write) that live in an object store."""
    from lmforge.data.remote import is_remote

    reads = [d.path for d in cfg.train_data]
    if cfg.eval.data_path:
        reads.append(cfg.eval.data_path)
    if isinstance(cfg.tokenizer, str):
        reads.append(cfg.tokenizer)
    if cfg.custom_weights_path:
        reads.append(cfg.custom_weights_path)
    writes = [cfg.save_folder] if cfg.save_folder else []
    return [u for u in reads if is_remote(u)], [u for u in writes if is_remote(u)]


def check_credentials(cfg, log=print) -> list[str]:
    """Read access to each remote input, write access (put + delete) to a remote save_folder.

    Fails fast (short timeouts, no retries) with one line naming the URI and bucket. Returns the
    lines describing what was checked.
    """
    from lmforge.data.remote import fs_and_path

    reads, writes = _access_points(cfg)
    done = []
    for uri in reads:
        t = time.monotonic()
        fs, path = fs_and_path(uri, fast_fail=True)
        try:
            if not _bucket_exists(fs, _bucket(uri)):
                raise UserError(f"credentials check: cannot read {uri}: bucket {_bucket(uri)!r} does not exist")
            if re.search(r"[*?\[]", path):
                found = bool(fs.glob(path))
            else:
                try:
                    found = bool(fs.info(path))  # raises for denied access (exists() would say False)
                except FileNotFoundError:
                    found = False
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - any client error becomes one line
            raise UserError(f"credentials check: cannot read {uri} (bucket {_bucket(uri)!r}): {_why(e)}") from None
        if not found:
            raise UserError(f"credentials check: {uri} not found (bucket {_bucket(uri)!r})")
        done.append(f"read  {uri}: ok ({time.monotonic() - t:.1f}s)")
        log(f"credentials: {done[-1]}")
    for uri in writes:
        t = time.monotonic()
        fs, path = fs_and_path(uri, fast_fail=True)
        probe = f"{path.rstrip('/')}/.lmforge-write-check-{uuid.uuid4().hex[:8]}"
        try:
            # Some servers create a missing bucket on the first write; a typo must not do that.
            if not _bucket_exists(fs, _bucket(uri)):
                raise FileNotFoundError(_bucket(uri))
            fs.pipe_file(probe, json.dumps({"check": "lmforge"}).encode())
            fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001
            bucket = _bucket(uri)
            why = _why(e)
            if isinstance(e, FileNotFoundError) or "NoSuchBucket" in why:
                why = "the bucket does not exist"
            raise UserError(f"credentials check: cannot write to {uri} (bucket {bucket!r}): {why}") from None
        done.append(f"write {uri}: ok ({time.monotonic() - t:.1f}s)")
        log(f"credentials: {done[-1]}")
    return done
