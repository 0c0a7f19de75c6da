"""Triton's response cache (``response_cache { enable: true }`` with ``--cache-config
local,size=N``): a request identical to an earlier one is answered with that one's response,
without running the model.

The cache is shared by every replica on a node: each entry is one file in a directory on the
node's memory file system (``/dev/shm``), named by the hash of what decides the response (the
model, its version and files, the inputs' names, datatypes, shapes and bytes, the requested
outputs and the parameters the model sees). A hit reads the file; a miss writes it once the model
answered. The directory stays under ``size`` bytes: a process that finds the total over it removes
the entries used longest ago (a hit touches its file) until the total is under nine tenths of it.
Each process counts what it wrote since it last summed the directory, so the bound holds to
within the entries the other processes wrote meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import logging
import os
import shutil
from pathlib import Path

import numpy as np

from rayinfer.protocol.dtypes import array_from_buffer, serialize_bytes_tensor
from rayinfer.protocol.private_folders import ownership_problem, per_user_path, private_folder
from rayinfer.protocol.types import InferOutput, InferRequest, InferResponse

logger = logging.getLogger(__name__)

# Request parameters that change nothing in the response (how it travels, who asked).
_TRANSPORT_PARAMETERS = frozenset({"binary_data_output", "priority", "timeout", "headers"})
# A process sums the directory again after this many of its own insertions at the latest.
_RESUM_EVERY = 64
# The names of entries (hashes) and of model folders: nothing else in the cache is touched.
_NAME = re.compile(r"[0-9a-f]{32,40}")


def parse_cache_config(values: list[str]) -> int:
    """The local cache's size in bytes from tritonserver's ``--cache-config`` values
    (``local,size=N``, possibly given as several flags); 0 when there is none."""
    size = 0
    for value in values:
        name, _, setting = value.partition(",")
        if name != "local":
            raise ValueError(f"unsupported cache '{name}' in --cache-config {value} (rayinfer has 'local')")
        key, _, number = setting.partition("=")
        if key != "size" or not number.isdigit():
            raise ValueError(f"--cache-config {value}: expected local,size=<bytes>")
        size = int(number)
    return size


def default_root() -> Path:
    """Where the node's cache directories live: this user's folder on the memory file system
    when there is one, else in the temporary directory (:mod:`private_folders`)."""
    shm = Path("/dev/shm")
    return per_user_path("rayinfer-response-cache", shm if shm.is_dir() and os.access(shm, os.W_OK) else None)


def clear(root: Path) -> None:
    """Remove every entry (a server starting: its models may differ from the last one's). A
    folder that is not this user's private one is left alone (the cache refuses it)."""
    if ownership_problem(root) is None:
        shutil.rmtree(root, ignore_errors=True)


def model_fingerprint(model_dir: Path, version: str, config_json: str) -> str:
    """What identifies a model's answers: its config and its version's files (names, sizes and
    modification times), so that a model changed on disk never meets its old entries."""
    digest = hashlib.blake2b(config_json.encode(), digest_size=16)
    version_dir = model_dir / version
    for path in sorted(p for p in version_dir.rglob("*") if p.is_file()) if version_dir.is_dir() else ():
        stat = path.stat()
        digest.update(f"{path.relative_to(version_dir)}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _entries(root: Path) -> list[tuple[int, int, str]]:
    """(modification time ns, size, path) of every entry in the node's cache (hash-named files in
    hash-named folders; links and anything else are left alone)."""
    found: list[tuple[int, int, str]] = []
    for directory in root.iterdir() if root.is_dir() else ():
        if not _NAME.fullmatch(directory.name) or directory.is_symlink():
            continue
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if not (_NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)):
                        continue
                    try:
                        status = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed by another replica meanwhile
                        continue
                    found.append((status.st_mtime_ns, status.st_size, entry.path))
        except (FileNotFoundError, NotADirectoryError):  # a folder removed meanwhile
            continue
    return found


def usage(root: Path) -> tuple[int, int]:
    """(bytes, entries) of every entry in the node's cache."""
    entries = _entries(root)
    return sum(size for _, size, _ in entries), len(entries)


class ResponseCache:
    """One model version's view of the node's cache (``root``), bounded at ``size_bytes`` in all."""

    def __init__(self, root: Path, model: str, version: str, fingerprint: str, size_bytes: int) -> None:
        self._root = root
        self._size_bytes = size_bytes
        self._directory = root / hashlib.blake2b(f"{model}\0{version}\0{fingerprint}".encode(),
                                                 digest_size=16).hexdigest()
        private_folder(root)  # the cache reads and deletes only its own files: UnsafeFolderError otherwise
        self._directory.mkdir(mode=0o700, exist_ok=True)
        self.evictions = 0  # entries this process removed to stay under the size
        self._written = 0  # bytes this process wrote since it last summed the directory
        self._total = 0  # the directory's size when last summed
        self._insertions = 0

    def key(self, request: InferRequest) -> str:
        """The hash of what decides the response to ``request``."""
        digest = hashlib.blake2b(digest_size=20)
        for tensor in request.inputs:
            digest.update(f"{tensor.name}\0{tensor.datatype}\0{tensor.shape}\0".encode())
            data = tensor.data
            if data.dtype == object:  # BYTES: each element's length and bytes
                for item in data.reshape(-1):
                    raw = item.encode() if isinstance(item, str) else bytes(item)
                    digest.update(len(raw).to_bytes(8, "little"))
                    digest.update(raw)
            else:
                digest.update(np.ascontiguousarray(data).tobytes())
        outputs = sorted((o.name, sorted(o.parameters.items())) for o in request.outputs or ())
        parameters = sorted((k, v) for k, v in request.parameters.items() if k not in _TRANSPORT_PARAMETERS)
        digest.update(repr((outputs, parameters)).encode())
        return digest.hexdigest()

    def get(self, key: str, request: InferRequest, model: str, version: str) -> InferResponse | None:
        """The cached response to a request with this key (with ``request``'s id), or None."""
        path = self._directory / key
        try:
            with open(path, "rb") as file:
                payload = file.read()
            os.utime(path)  # used now: the last to be evicted
            return decode_entry(payload, request, model, version)
        except (OSError, ValueError, KeyError):  # gone meanwhile (evicted), or not whole
            return None

    def put(self, key: str, response: InferResponse) -> bool:
        """Keep ``response`` (one larger than the whole cache is not kept); True when the cache
        should be trimmed now (:meth:`trim`: off the event loop, it reads every entry's size)."""
        payload = encode_entry(response)
        if len(payload) > self._size_bytes:
            return False
        path = self._directory / key
        temporary = path.with_name(f".{key}.{os.getpid()}")
        try:
            try:
                file = open(temporary, "wb")
            except FileNotFoundError:  # the directory was cleared (a server starting): again
                self._directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                file = open(temporary, "wb")
            with file:
                file.write(payload)
            os.replace(temporary, path)  # whole or not at all, for the other replicas
        except OSError as exc:  # the memory file system is full: no entry
            logger.debug("could not cache a response of %s: %s", self._directory, exc)
            temporary.unlink(missing_ok=True)
            return False
        self._written += len(payload)
        self._insertions += 1
        return self._total + self._written > self._size_bytes or self._insertions >= _RESUM_EVERY

    def trim(self) -> None:
        """Sum the node's entries; remove the least recently used while over the bound."""
        entries = _entries(self._root)
        total = sum(size for _, size, _ in entries)
        if total > self._size_bytes:
            target = self._size_bytes * 0.9
            for _, size, path in sorted(entries):
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):  # another replica evicted it first
                    os.unlink(path)
                    self.evictions += 1
                total -= size
        self._total, self._written, self._insertions = total, 0, 0

    def entry_count(self) -> int:
        """Entries of this model version on the node now."""
        try:
            return sum(1 for name in os.listdir(self._directory) if _NAME.fullmatch(name))
        except FileNotFoundError:
            return 0


def encode_entry(response: InferResponse) -> bytes:
    """An entry's bytes: a JSON header (its length first, 8 bytes) then each output's raw data."""
    chunks, outputs = [], []
    for out in response.outputs:
        raw = serialize_bytes_tensor(out.data) if out.datatype == "BYTES" else np.ascontiguousarray(out.data).tobytes()
        outputs.append({"name": out.name, "datatype": out.datatype, "shape": list(out.shape), "size": len(raw),
                        "parameters": out.parameters})
        chunks.append(raw)
    header = json.dumps({"outputs": outputs, "parameters": response.parameters}).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(chunks)


def decode_entry(payload: bytes, request: InferRequest, model: str, version: str) -> InferResponse:
    header_length = int.from_bytes(payload[:8], "little")
    doc = json.loads(payload[8:8 + header_length])
    view = memoryview(payload)[8 + header_length:]
    outputs, offset = [], 0
    for out in doc["outputs"]:
        data = array_from_buffer(view[offset:offset + out["size"]], out["datatype"], out["shape"], out["name"],
                                 f"cached output '{out['name']}'", lambda got, want: f"{got} != {want} bytes")
        offset += out["size"]
        outputs.append(InferOutput(out["name"], out["datatype"], tuple(out["shape"]), data, out["parameters"]))
    return InferResponse(model, version, outputs, id=request.id, parameters=doc["parameters"])
