"""Model repositories on S3 and S3-compatible object stores, served from a node-local copy.

Triton's forms: ``s3://bucket/path`` (Amazon S3), ``s3://host:port/bucket/path`` (an
S3-compatible server over HTTP) and ``s3://https://host:port/bucket/path`` (over HTTPS).
Credentials and region come from the environment or the AWS config files, the environment
first, as boto3 (and Triton) read them.

Every process that reads the repository calls :func:`local_repository` with the URL: the
objects under the path are copied to a folder on its node (``TRITON_AWS_MOUNT_DIRECTORY``, or
one per URL in this user's private folder under the temporary directory,
:mod:`~rayinfer.protocol.private_folders`) and the folder is returned, so that the rest of the
server reads a repository on disk as before. A copy is brought up to date by ETag: objects that
did not change are not downloaded again (nor touched, so the poller sees no change), new and
changed ones are, and files whose object went are removed. ``models`` limits a copy to those
model folders (a model replica needs only its own). Processes on one node share the copy under
a file lock; each file is replaced whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.private_folders import UnsafeFolderError, private_temporary_folder

logger = logging.getLogger(__name__)

MOUNT_DIRECTORY_VARIABLE = "TRITON_AWS_MOUNT_DIRECTORY"
_OBJECTS_FILE = ".rayinfer-objects.json"  # relative path -> ETag of the object it was copied from
_LOCK_FILE = ".rayinfer-lock"
_UNSUPPORTED_SCHEMES = {"gs://": "Google Cloud Storage", "as://": "Azure Storage"}


@dataclass(frozen=True)
class S3Location:
    """Where an ``s3://`` repository lies: the endpoint (None: Amazon S3), bucket and key prefix."""

    endpoint_url: str | None
    bucket: str
    prefix: str  # "" or ending in "/"


def is_remote(repository: str | os.PathLike[str]) -> bool:
    """Whether ``repository`` is an object-store URL rather than a folder."""
    text = str(repository)
    return text.startswith("s3://") or any(text.startswith(scheme) for scheme in _UNSUPPORTED_SCHEMES)


def parse_s3_url(url: str) -> S3Location:
    """Triton's three ``s3://`` forms; a malformed one raises naming the URL."""
    for unsupported, store in _UNSUPPORTED_SCHEMES.items():
        if url.startswith(unsupported):
            raise ModelConfigError(f"model repository '{url}': {store} is not supported; use a local folder or an "
                                   "s3:// URL (an S3-compatible endpoint of that store, for example)")
    if not url.startswith("s3://"):
        raise ModelConfigError(f"model repository '{url}' is not an s3:// URL")
    rest = url[len("s3://"):]
    scheme: str | None = None
    for given in ("https", "http"):
        if rest.startswith(f"{given}://"):
            scheme, rest = given, rest[len(given) + 3:]
            break
    parts = rest.split("/", 1)
    endpoint = None
    if scheme is not None or ":" in parts[0]:  # s3://[http[s]://]host:port/bucket/path
        if not parts[0] or len(parts) < 2:
            raise ModelConfigError(f"model repository '{url}': expected s3://host:port/bucket/path")
        endpoint = f"{scheme or 'http'}://{parts[0]}"
        parts = parts[1].split("/", 1)
    bucket = parts[0]
    if not bucket:
        raise ModelConfigError(f"model repository '{url}' names no bucket")
    prefix = parts[1].strip("/") if len(parts) > 1 else ""
    return S3Location(endpoint, bucket, f"{prefix}/" if prefix else "")


def local_repository(repository: str | os.PathLike[str], models: Iterable[str] | None = None) -> Path:
    """The repository as a folder on this node: a local one as given; an ``s3://`` one copied
    (its ``models`` folders only, when given) and brought up to date first."""
    if not is_remote(repository):
        return Path(repository)
    url = str(repository)
    location = parse_s3_url(url)
    try:
        root = _copy_root(url)
    except UnsafeFolderError as exc:
        raise ModelConfigError(f"model repository '{url}': {exc}") from None
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        _synchronize(location, root, None if models is None else sorted(set(models)), url)
    return root


def _copy_root(url: str) -> Path:
    """The folder of the copy: the one the user named, else one per URL in this user's private
    folder (UnsafeFolderError when something else is in that folder's place)."""
    mount = os.environ.get(MOUNT_DIRECTORY_VARIABLE)
    if mount:
        return Path(mount)
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return private_temporary_folder("rayinfer-repositories") / digest


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    with open(root / _LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _client(location: S3Location) -> Any:
    try:
        import boto3
    except ImportError:  # a dependency of rayinfer: only a broken install lacks it
        raise ModelConfigError("an s3:// model repository needs boto3 (pip install boto3)") from None
    return boto3.session.Session().client("s3", endpoint_url=location.endpoint_url)


def _synchronize(location: S3Location, root: Path, models: list[str] | None, url: str) -> None:
    client = _client(location)
    prefixes = [location.prefix] if models is None else [f"{location.prefix}{m}/" for m in models]
    listed: dict[str, str] = {}  # relative path -> ETag
    try:
        for prefix in prefixes:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
                for item in page.get("Contents", ()):
                    relative = _relative_path(item["Key"], location.prefix)
                    if relative is not None:
                        listed[relative] = item["ETag"]
    except Exception as exc:
        raise ModelConfigError(f"model repository '{url}': cannot list its objects: {exc}") from None
    record_path = root / _OBJECTS_FILE
    try:
        record: dict[str, str] = json.loads(record_path.read_text())
    except (OSError, ValueError):
        record = {}
    in_scope = (lambda rel: True) if models is None else (lambda rel: rel.split("/", 1)[0] in models)
    for relative in [r for r in record if in_scope(r) and r not in listed]:
        (root / relative).unlink(missing_ok=True)
        del record[relative]
    fetched = 0
    try:
        for relative, etag in listed.items():
            target = root / relative
            if record.get(relative) == etag and target.is_file():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.partial")
            client.download_file(location.bucket, location.prefix + relative, str(partial))
            os.replace(partial, target)
            record[relative] = etag
            fetched += 1
    except Exception as exc:
        raise ModelConfigError(f"model repository '{url}': cannot copy '{relative}': {exc}") from None
    finally:
        record_path.write_text(json.dumps(record, sort_keys=True))
    _remove_empty_folders(root)
    if fetched:
        logger.info("model repository %s: copied %d changed object(s) to %s", url, fetched, root)


def _relative_path(key: str, prefix: str) -> str | None:
    """The key's path inside the repository; None for folder markers and keys that would
    leave the copy's folder (``..``, absolute parts) or hide among its own files."""
    if not key.startswith(prefix) or key.endswith("/"):
        return None
    parts = key[len(prefix):].split("/")
    if any(part in ("", ".", "..") or "\\" in part for part in parts):
        logger.warning("model repository: skipping object '%s' (not a path inside the repository)", key)
        return None
    if parts[0] in (_OBJECTS_FILE, _LOCK_FILE):
        return None
    return "/".join(parts)


def _remove_empty_folders(root: Path) -> None:
    for folder, _, _ in os.walk(root, topdown=False):  # deepest first: a parent may empty in turn
        if Path(folder) != root and not os.listdir(folder):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
