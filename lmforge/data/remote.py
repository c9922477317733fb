"""Object-store helpers over fsspec, shared by datasets and checkpoints.

A URI with a scheme other than ``file://`` is remote (``s3://``, ``gs://``, ``memory://``, ...).
For S3, the endpoint comes from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` and credentials
from the usual ``AWS_*`` variables; the endpoint is passed to s3fs explicitly so that it works
whatever botocore version is installed.
"""

from __future__ import annotations

import gc
import os
import random
import tempfile
import time
from pathlib import Path

import fsspec

from lmforge.errors import UserError
from lmforge.uri import is_remote, local_path  # noqa: F401 - the data layer's names for them


# Clients inherited from the parent by a forked process, kept alive on purpose (see below).
_inherited: list = []


def keep_inherited_clients() -> None:
    """Call first thing in a forked worker (e.g. a DataLoader ``worker_init_fn``).

    A forked child must never finalize the object-store clients it inherited: closing them
    unregisters the parent's sockets from the event loop's epoll, which parent and child
    share, and the parent's next request then stalls until a timeout. fsspec drops its
    parent's cached filesystems in a child (refcount -> finalizer) and inherited garbage may be
    collected there, so: hold the cached instances, and freeze everything inherited out of the
    collector's reach (workers exit with ``os._exit``, so nothing is finalized at exit either).
    """
    gc.freeze()
    stack = [fsspec.AbstractFileSystem]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        cache = cls.__dict__.get("_cache")
        if cache and cls.__dict__.get("_pid") != os.getpid():
            _inherited.extend(cache.values())


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or a URI with ``/``."""
    if not is_remote(uri):
        return str(Path(local_path(uri), *parts))
    return "/".join([str(uri).rstrip("/"), *(p.strip("/") for p in parts)])


def _s3_options() -> dict:
    opts: dict = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    return opts


def _fast_fail_options(scheme: str) -> dict:
    """Short timeouts and no client retries: for checks that must answer in seconds."""
    if scheme in ("s3", "s3a"):
        return {"skip_instance_cache": True,
                "config_kwargs": {"connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 1}}}
    if scheme in ("gs", "gcs"):
        return {"skip_instance_cache": True, "timeout": 5}
    return {}


def fs_and_path(uri: str, *, fast_fail: bool = False) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path within it) for a local path or a URI.

    ``fast_fail``: a fresh client with short timeouts and no retries (credential checks).
    """
    uri = str(uri)
    if not is_remote(uri):
        return fsspec.filesystem("file"), os.path.abspath(local_path(uri))
    scheme = uri.split("://", 1)[0]
    opts = _s3_options() if scheme in ("s3", "s3a") else {}
    if fast_fail:
        opts |= _fast_fail_options(scheme)
    try:
        fs, path = fsspec.core.url_to_fs(uri, **opts)
    except (ImportError, ValueError) as e:
        raise UserError(f"{uri}: cannot open this kind of URI ({e})") from None
    if fast_fail and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop on top of botocore's
    return fs, path


def exists(uri: str) -> bool:
    """Whether a file or folder exists at ``uri`` (a missing bucket counts as missing)."""
    fs, path = fs_and_path(uri)
    try:
        return bool(fs.exists(path))
    except (FileNotFoundError, PermissionError):
        return False


class StoreError(UserError):
    """The object store refused or failed (access denied, the network after retries): not the data's
    fault, so a job keeps what it wrote, for the same command to go on from."""


def _retry(what: str, fn, retries: int, backoff: float):
    """Run ``fn`` with exponential backoff; missing objects and permission errors are not retried."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise UserError(f"{what}: not found") from None
        except PermissionError as e:
            raise StoreError(f"{what}: access denied ({e})") from None
        except UserError:
            raise
        except Exception as e:  # network errors, throttling, truncated transfers
            if attempt == retries:
                raise StoreError(f"{what}: failed after {retries + 1} attempts ({type(e).__name__}: {e})") from None
            time.sleep(backoff * (2**attempt) * (1 + random.random() * 0.25))


def download(uri: str, local: str, retries: int = 5, backoff: float = 0.5, size: int | None = None) -> None:
    """Copy ``uri`` to the local file ``local`` atomically, retrying; check ``size`` if given."""
    fs, path = fs_and_path(uri)
    dest = Path(local)
    dest.parent.mkdir(parents=True, exist_ok=True)

    def once() -> None:
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        os.close(fd)
        try:
            fs.get_file(path, tmp)
            got = os.path.getsize(tmp)
            if size is not None and got != size:
                raise OSError(f"got {got} bytes, expected {size}")
            os.replace(tmp, dest)
        finally:
            Path(tmp).unlink(missing_ok=True)

    _retry(uri, once, retries, backoff)


def upload_file(local: str, uri: str, retries: int = 5, backoff: float = 0.5) -> None:
    """Copy one local file to ``uri``, retrying."""
    fs, path = fs_and_path(uri)
    _retry(uri, lambda: fs.put_file(str(local), path), retries, backoff)


def upload_dir(local_dir: str, uri: str, retries: int = 5, backoff: float = 0.5, last: str = "index.json") -> None:
    """Upload every file under ``local_dir`` to ``uri``; top-level ``last`` (the index) goes last.

    Uploading the index last means a reader never sees an index whose shards are not there yet.
    A missing bucket is a UserError naming the URI.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise UserError(f"{local_dir}: folder to upload not found")
    if is_remote(uri):
        fs, path = fs_and_path(uri)
        bucket = path.split("/", 1)[0]
        try:
            bucket_ok = fs.exists(bucket)
        except Exception as e:
            raise UserError(f"{uri}: cannot reach the object store ({type(e).__name__}: {e})") from None
        if not bucket_ok:
            raise UserError(f"{uri}: bucket {bucket!r} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    files.sort(key=lambda p: p.relative_to(root).as_posix() == last)
    for p in files:
        rel = p.relative_to(root).as_posix()
        if is_remote(uri):
            upload_file(str(p), join(uri, rel), retries, backoff)
        else:
            dest = Path(local_path(uri), rel)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.resolve() != p.resolve():
                tmp = dest.with_name(f".{dest.name}.part")
                tmp.write_bytes(p.read_bytes())
                os.replace(tmp, dest)


def put_bytes(uri: str, data: bytes, retries: int = 5, backoff: float = 0.5) -> None:
    """Write ``data`` as the whole object/file ``uri`` (an object-store PUT is atomic; a local file is
    written beside and renamed), retrying."""
    if not is_remote(uri):
        write_local_atomic(Path(local_path(uri)), data)
        return
    fs, path = fs_and_path(uri)
    _retry(uri, lambda: fs.pipe_file(path, data), retries, backoff)


def write_local_atomic(dest: Path, data: bytes) -> None:
    """Write via a temp file and a rename, so that readers never see a half-written file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        # mkstemp creates 0600; a dataset should be readable like any file this user writes.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def get_bytes(uri: str, retries: int = 5, backoff: float = 0.5) -> bytes | None:
    """The content of ``uri``; None when it does not exist."""
    if not is_remote(uri):
        try:
            return Path(local_path(uri)).read_bytes()
        except FileNotFoundError:
            return None
    fs, path = fs_and_path(uri)
    try:
        return _retry(uri, lambda: fs.cat_file(path), retries, backoff)
    except UserError as e:
        if str(e).endswith(": not found"):
            return None
        raise


def get_range(uri: str, start: int, end: int, retries: int = 5, backoff: float = 0.5) -> bytes:
    """Bytes [start, end) of the file/object ``uri`` (one ranged read), retrying."""
    if not is_remote(uri):
        with open(local_path(uri), "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, path = fs_and_path(uri)
    return _retry(uri, lambda: fs.cat_file(path, start=start, end=end), retries, backoff)


def listdir(uri: str) -> list[str]:
    """Sorted names of the files and folders directly in ``uri``; [] when it does not exist."""
    if not is_remote(uri):
        try:
            return sorted(os.listdir(local_path(uri)))
        except FileNotFoundError:
            return []
    fs, path = fs_and_path(uri)
    try:
        fs.invalidate_cache(path)
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


def remove_tree(uri: str) -> None:
    """Remove the folder ``uri`` and everything under it, or the file ``uri``, if it exists."""
    if not is_remote(uri):
        import shutil

        if os.path.isdir(local_path(uri)):
            shutil.rmtree(local_path(uri), ignore_errors=True)
        elif os.path.lexists(local_path(uri)):
            os.remove(local_path(uri))
        return
    fs, path = fs_and_path(uri)
    fs.invalidate_cache()  # a cached listing may predate what this process just wrote
    try:
        found = fs.find(path, withdirs=True, detail=True)
    except FileNotFoundError:
        return
    files = [p for p, info in found.items() if info.get("type") != "directory"]
    if files:
        fs.rm(files)  # the files, never a bucket (``uri`` may be a bucket's root)
    scheme = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if scheme in ("s3", "s3a") and "/" in path:
        # Stores with real folders (SeaweedFS, MinIO) keep emptied folders as keys "folder/", also
        # ones emptied earlier (which a listing of files does not show): deepest first.
        folders = {p for p, info in found.items() if info.get("type") == "directory"} | {path}
        for _ in range(2):
            for folder in sorted(folders, key=lambda p: -p.count("/")):
                bucket, key = folder.split("/", 1)
                try:
                    fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")
                except (FileNotFoundError, PermissionError):
                    pass
            fs.invalidate_cache()
            folders = _empty_folders(fs, path)  # only where the store keeps folders is anything left
            if not folders:
                break
            folders.add(path)


def _empty_folders(fs, path: str) -> set[str]:
    out, todo = set(), [path]
    while todo:
        p = todo.pop()
        try:
            entries = fs.ls(p, detail=True)
        except FileNotFoundError:
            continue
        for e in entries:
            name = e["name"].rstrip("/")
            if e.get("type") == "directory" and name != p.rstrip("/"):
                out.add(name)
                todo.append(name)
    return out


def datatrove_folder(uri: str):
    """``uri`` (local or on an object store) as datatrove's DataFolder (its executors' logs, its
    MinHash steps' inputs and outputs)."""
    from datatrove.io import DataFolder

    fs, path = fs_and_path(uri)
    return DataFolder(path, fs=fs)
