"""Folders of this user under a shared directory (the temporary directory, ``/dev/shm``) that
the server reuses from one start to the next: a cache of the response cache, copies of ``s3://``
repositories, pip environments, unpacked execution environments.

Every other local user may create entries in a shared directory. A folder found there with the
name the server expects may have been planted: a link to elsewhere, or a folder others can write
into, so that the server would import their packages or read their model files. So each such
folder is per user (``<name>-<uid>``), created with mode 0700 when missing, and checked when it
exists: a directory itself (not a link), owned by this user, with no permission for the group or
others. One that is not is refused with :class:`UnsafeFolderError` naming it and what is wrong;
it is never used, changed or removed. In a directory with the sticky bit (``/tmp``,
``/dev/shm``), a folder that passed the check stays this user's: no one else can rename or
remove it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class UnsafeFolderError(PermissionError):
    """A folder the server would reuse is not a private folder of this user."""

    def __init__(self, message: str):
        super().__init__(message)


def per_user_path(name: str, base: Path | None = None) -> Path:
    """``<base>/<name>-<uid>``, ``base`` being the temporary directory unless given; the path only
    (:func:`private_folder` creates and checks it)."""
    return Path(tempfile.gettempdir() if base is None else base) / f"{name}-{os.getuid()}"


def ownership_problem(path: Path) -> str | None:
    """What makes ``path`` unfit to hold this user's private files, or None when it is a
    directory (not a link to one) of this user with no permission for the group or others."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return "it does not exist"
    if stat.S_ISLNK(status.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(status.st_mode):
        return "it is not a directory"
    if status.st_uid != os.getuid():
        return f"it belongs to uid {status.st_uid}, not to this user (uid {os.getuid()})"
    mode = stat.S_IMODE(status.st_mode)
    if mode & 0o077:
        return f"its mode {mode:04o} lets the group or others in (expected 0700)"
    return None


def private_folder(path: Path) -> Path:
    """``path``, created with mode 0700 when missing; UnsafeFolderError naming it and the reason
    when it exists and is not a directory of this user closed to everyone else."""
    with contextlib.suppress(FileExistsError):  # whatever is there (a link, a file) is checked below
        path.mkdir(mode=0o700, parents=True)
    problem = ownership_problem(path)
    if problem is not None:
        raise UnsafeFolderError(f"refusing to use the folder {path}: {problem}; another local user may have "
                                "planted it: remove it, or set TMPDIR to a directory of your own")
    return path


def private_temporary_folder(name: str) -> Path:
    """This user's private folder ``<temporary directory>/<name>-<uid>``, created or checked
    (:func:`private_folder`)."""
    return private_folder(per_user_path(name))
