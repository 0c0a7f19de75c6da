"""Model files carried by a load request (``file:<version>/<name>`` parameters).

As in Triton, such a load serves the model from a temporary model directory holding exactly
those files (the request's ``config`` parameter is its configuration), never from the
repository's copy. Every path is checked before anything is written: relative, no ``.`` or
``..`` components, no component longer than NAME_MAX, and inside the temporary directory; a
request carries at most :data:`MAX_FILES` files (their bytes are bounded by the request's size
limit).
"""

from __future__ import annotations

import base64
import binascii
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from rayinfer.protocol.errors import InvalidArgError

FILE_PREFIX = "file:"
_NAME_MAX_BYTES = 255
MAX_FILES = 1024
# Triton's limit on one file's decoded bytes.
_INT_MAX = 2**31 - 1


def file_parameters(model: str, parameters: dict[str, Any]) -> dict[str, bytes]:
    """The ``file:`` parameters as {relative path: content}; HTTP sends contents base64-encoded,
    gRPC as bytes."""
    count = sum(1 for key in parameters if key.startswith(FILE_PREFIX))
    if count > MAX_FILES:
        raise InvalidArgError(f"failed to load '{model}': {count} 'file:' parameters, more than the "
                              f"{MAX_FILES} a load request may carry")
    files = {}
    for key, value in parameters.items():
        if not key.startswith(FILE_PREFIX):
            continue
        encoded_max = _INT_MAX if isinstance(value, bytes) else _INT_MAX // 3 * 4 + 4  # base64: 4 chars per 3 bytes
        if isinstance(value, (str, bytes)) and len(value) > encoded_max:  # Triton's limit, its words
            raise InvalidArgError(f"'{key}' exceeds the maximum allowed data size limit INT_MAX")
        if isinstance(value, str):
            try:
                value = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidArgError(f"failed to load '{model}': '{key}' is not valid base64") from None
        if not isinstance(value, bytes):
            raise InvalidArgError(f"failed to load '{model}': '{key}' must carry the file's bytes")
        files[key[len(FILE_PREFIX):]] = value
    return files


def checked_relative_path(model: str, path: str) -> PurePosixPath:
    """``path`` as a safe relative path, or INVALID_ARG naming it."""
    relative = PurePosixPath(path)
    parts = relative.parts
    if (not path or relative.is_absolute() or "\\" in path or "\0" in path or not parts
            or any(part in (".", "..") or len(part.encode()) > _NAME_MAX_BYTES for part in parts)):
        raise InvalidArgError(f"failed to load '{model}': Invalid file path '{FILE_PREFIX}{path}'")
    return relative


def write_model_directory(model: str, files: dict[str, bytes]) -> Path:
    """A new temporary repository root holding ``<root>/<model>/<files>``; returns the root."""
    checked = {checked_relative_path(model, path): content for path, content in files.items()}
    root = Path(tempfile.mkdtemp(prefix="rayinfer-load-"))
    model_dir = (root / model).resolve()
    try:
        model_dir.mkdir()
        for relative, content in checked.items():
            target = (model_dir / relative).resolve()
            if not target.is_relative_to(model_dir):
                raise InvalidArgError(f"failed to load '{model}': Invalid file path '{FILE_PREFIX}{relative}'")
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            except OSError as exc:  # e.g. both 'file:1/a' and 'file:1/a/b'
                raise InvalidArgError(
                    f"failed to load '{model}': cannot write '{FILE_PREFIX}{relative}': {exc.strerror}"
                ) from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root
