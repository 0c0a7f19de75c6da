"""A Python model's own packages (``requirements.txt`` or the ``pip_requirements`` parameter,
:mod:`rayinfer.repository.python_env`), installed once per node and requirement list.

pip installs into a small virtualenv of its own whose interpreter also sees the server's
packages (a ``.pth`` file adds the server's site-packages), so pip installs only what the server
lacks, and the replica puts that virtualenv's ``site-packages`` first on ``sys.path`` before
importing ``model.py``. Nothing of the server's environment is copied (Ray's ``pip`` runtime
environment clones the whole virtualenv the server runs in, per node: gigabytes with torch).
A package the replica imported before the model (numpy, protobuf, grpc) keeps the server's
version.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import site
import subprocess
import sys
from pathlib import Path

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.private_folders import UnsafeFolderError, private_temporary_folder

ROOT_PREFIX = "rayinfer-pip"
PIP_TIMEOUT_S = 900.0


def environment_root(packages: list[str]) -> Path:
    """The folder of the virtualenv for ``packages`` on this node (shared by the replicas), in this
    user's private folder ``<temporary directory>/rayinfer-pip-<uid>``: the replicas import from it,
    so a folder another user planted there is refused (UnsafeFolderError), never used."""
    key = hashlib.sha256("\n".join([sys.executable, sys.version, *packages]).encode()).hexdigest()[:20]
    return private_temporary_folder(ROOT_PREFIX) / key


def activate_requirements(packages: list[str], model: str, timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """Install ``packages`` unless an earlier replica on this node did, and put their
    site-packages first on ``sys.path``; returns it. ModelConfigError with pip's own reason when
    pip fails, or naming the folder when the environments' folder is not this user's own."""
    try:
        root = environment_root(packages)
    except UnsafeFolderError as exc:
        raise ModelConfigError(f"model '{model}': cannot install the model's requirements: {exc}") from None
    site_packages = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    done = root / ".installed"
    if not done.exists():
        with open(root.parent / f"{root.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one installation per node; the others wait for it
            if not done.exists():
                _install(root, site_packages, packages, model, timeout_s)
                done.touch()
    if str(site_packages) not in sys.path:
        sys.path.insert(0, str(site_packages))
    return site_packages


def _install(root: Path, site_packages: Path, packages: list[str], model: str, timeout_s: float) -> None:
    shutil.rmtree(root, ignore_errors=True)  # an installation that did not finish
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    # The new interpreter sees the server's packages (with their own .pth files), after its own.
    server_sites = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (site_packages / "_rayinfer_server_packages.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({p!r})" for p in server_sites) + "\n")
    requirements = root / "requirements.txt"
    requirements.write_text("\n".join(packages) + "\n")
    command = [sys.executable, "-m", "pip", "--python", str(root / "bin" / "python"), "install", "--no-input",
               "--disable-pip-version-check", "--no-warn-script-location", "-r", str(requirements)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        shutil.rmtree(root, ignore_errors=True)
        raise ModelConfigError(f"model '{model}': pip did not install the model's requirements within "
                               f"{timeout_s:.0f} s") from None
    if result.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise ModelConfigError(f"pip could not install the model's requirements: {pip_reason(result.stderr)}")


def pip_reason(stderr: str) -> str:
    """pip's last ``ERROR:`` line (its conclusion), else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    return errors[-1] if errors else (lines[-1] if lines else "pip failed without a message")
