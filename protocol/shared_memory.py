"""Triton's shared memory extensions: registered regions of POSIX shared memory (system) or of
CUDA device memory (CUDA) that requests read their inputs from and responses write their
outputs to.

A client creates a shared memory object (``shm_open(key)``, which is ``/dev/shm/<key>`` on
Linux), registers a named window of it (``offset``, ``byte_size``) with the server, and then
names the region in a tensor's parameters (``shared_memory_region``,
``shared_memory_byte_size``, ``shared_memory_offset`` within the region). The memory is the
node's own: a region is usable only by processes on the client's node. A CUDA region is device
memory the client shares through a CUDA IPC handle (:mod:`~rayinfer.protocol.cuda_memory`), with
the same parameters naming it; region names are one namespace for both kinds, as in Triton.

:class:`SharedMemoryRegistry` maps each region into the process that holds it. The ``/v2``
replica keeps the registrations clients make; a model replica keeps a cache that it fills on
first use (``fetch``) and empties when the ``/v2`` replica tells it a region was unregistered.
"""

from __future__ import annotations

import base64
import mmap
import os
from collections.abc import Awaitable, Callable
import stat
import threading
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from rayinfer.protocol.cuda_memory import IPC_HANDLE_BYTES, open_ipc_memory
from rayinfer.protocol.dtypes import serialize_bytes_tensor
from rayinfer.protocol.errors import Code, InvalidArgError, NotFoundError, ServingError, UnsupportedError

# The request and response parameters of a tensor held in shared memory.
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
TENSOR_PARAMETERS = (REGION, BYTE_SIZE, OFFSET)
_SHM_DIR = "/dev/shm"

SYSTEM, CUDA = "system", "cuda"
_BAD_HANDLE = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"


class Registration(NamedTuple):
    """A registration as the ``/v2`` replica hands it to a model replica: system memory's
    ``key``, ``offset`` and ``byte_size``, or (``raw_handle`` set) a CUDA region's IPC handle,
    device and ``byte_size``."""

    key: str
    offset: int
    byte_size: int
    device_id: int = 0
    raw_handle: bytes = b""

    @property
    def kind(self) -> str:
        return CUDA if self.raw_handle else SYSTEM


@dataclass(frozen=True, slots=True)
class TensorLocation:
    """Where one tensor lies: ``byte_size`` bytes at ``offset`` in the region ``region``;
    ``mapping``: the region as it was when the request was decoded (an output is written there
    even if the region is unregistered meanwhile)."""

    region: str
    offset: int
    byte_size: int
    mapping: Any = field(default=None, compare=False)


class RegionMissing(Exception):
    """A model replica's cache does not hold ``name`` yet: fetch it, then decode again."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def tensor_location(parameters: dict[str, Any], what: str) -> TensorLocation | None:
    """The shared memory a tensor's parameters name, or None; Triton's rule that the region and
    its byte size come together (the offset is optional and defaults to 0)."""
    if REGION not in parameters:
        if BYTE_SIZE in parameters or OFFSET in parameters:
            raise InvalidArgError(f"{what}: '{BYTE_SIZE}' and '{OFFSET}' need '{REGION}'")
        return None
    region = parameters[REGION]
    if not isinstance(region, str):
        raise ServingError(f"Unable to parse '{REGION}': attempt to access JSON non-string as string", Code.INTERNAL)
    values = []
    for key, default in ((OFFSET, 0), (BYTE_SIZE, None)):
        value = parameters.get(key, default)
        if value is None:
            raise InvalidArgError(f"{what}: '{REGION}' is set but '{BYTE_SIZE}' is not")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ServingError(f"Unable to parse '{key}': attempt to access JSON non-unsigned-integer as "
                               "unsigned-integer", Code.INTERNAL)
        values.append(value)
    return TensorLocation(region, values[0], values[1])


def registration_from_json(doc: dict[str, Any]) -> tuple[str, int, int]:
    """(key, offset, byte_size) of an HTTP register request's body."""
    key = doc.get("key")
    if not isinstance(key, str):
        raise InvalidArgError("Unable to parse 'key': expected a JSON string")
    return key, _unsigned(doc, "offset", 0), _unsigned(doc, "byte_size", 0)


def cuda_registration_from_json(doc: dict[str, Any]) -> tuple[bytes, int, int]:
    """(raw_handle, device_id, byte_size) of an HTTP CUDA register request's body, whose
    ``raw_handle`` is ``{"b64": <the handle in base64>}``; Triton's messages."""
    if "raw_handle" not in doc:
        raise InvalidArgError("Shared memory register request has no 'raw_handle' field")
    handle = doc["raw_handle"]
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(encoded, str):
        raise InvalidArgError("Unable to parse 'b64': expected a JSON string in 'raw_handle'")
    byte_size, device_id = _unsigned(doc, "byte_size"), _unsigned(doc, "device_id")
    try:
        raw_handle = base64.b64decode(encoded, validate=True)
    except ValueError:
        raw_handle = b""
    if len(raw_handle) != IPC_HANDLE_BYTES:
        raise InvalidArgError(_BAD_HANDLE)
    return raw_handle, device_id, byte_size


def _unsigned(doc: dict[str, Any], name: str, default: int | None = None) -> int:
    """A register body's unsigned integer field (``default`` when absent; None: required)."""
    value = doc.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgError(f"Unable to parse '{name}': expected a JSON unsigned integer")
    return value


def shm_path(key: str) -> str:
    """The file ``shm_open(key)`` names; a key that is not one name is refused (no paths)."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ServingError(f"Unable to open shared memory region: '{key}'", Code.INTERNAL)
    return os.path.join(_SHM_DIR, name)


def _window(name: str, base: int, region_bytes: int, offset: int, byte_size: int) -> tuple[int, int]:
    """[start, end) of ``byte_size`` bytes at ``offset`` in a region of ``region_bytes`` bytes
    that starts at ``base`` of its memory, with Triton's checks and messages."""
    if offset >= region_bytes:
        raise InvalidArgError(f"Invalid offset for shared memory region: '{name}'")
    if offset + byte_size > region_bytes:
        raise InvalidArgError(f"Invalid offset + byte size for shared memory region: '{name}'")
    return base + offset, base + offset + byte_size


class _Region:
    """One registered region mapped into this process (the file's first offset + byte_size bytes)."""

    __slots__ = ("key", "offset", "byte_size", "_map")
    kind = SYSTEM

    def __init__(self, name: str, key: str, offset: int, byte_size: int):
        path = shm_path(key)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # as shm_open: never a link to elsewhere
        except OSError:
            raise ServingError(f"Unable to open shared memory region: '{key}'", Code.INTERNAL) from None
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise ServingError(f"Unable to open shared memory region: '{key}'", Code.INTERNAL)
            size = status.st_size
            if offset + byte_size > size or byte_size == 0:
                raise InvalidArgError(f"failed to register shared memory region '{name}': invalid args")
            try:
                self._map = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except (OSError, ValueError) as exc:
                raise InvalidArgError(f"failed to register shared memory region '{name}': {exc}") from None
        finally:
            os.close(fd)
        self.key, self.offset, self.byte_size = key, offset, byte_size

    def registration(self) -> Registration:
        return Registration(self.key, self.offset, self.byte_size)

    def status(self, name: str) -> dict[str, Any]:
        return {"name": name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def window(self, name: str, offset: int, byte_size: int) -> tuple[int, int]:
        return _window(name, self.offset, self.byte_size, offset, byte_size)

    def read(self, name: str, start: int, end: int) -> bytes:
        return self._map[start:end]

    def write(self, name: str, start: int, data: bytes | memoryview) -> None:
        self._map[start:start + len(data)] = data


class _CudaRegion:
    """One registered CUDA region: its IPC handle, opened in this process when a request first
    reads or writes it (the ``/v2`` replica, which sees no GPU, only keeps it)."""

    __slots__ = ("raw_handle", "device_id", "byte_size", "_memory", "_lock")
    kind = CUDA

    def __init__(self, name: str, raw_handle: bytes, device_id: int, byte_size: int):
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise InvalidArgError(_BAD_HANDLE)
        if device_id < 0:
            raise InvalidArgError(f"failed to register shared memory region '{name}': invalid args")
        self.raw_handle, self.device_id, self.byte_size = raw_handle, device_id, byte_size
        self._memory: Any = None
        self._lock = threading.Lock()

    def registration(self) -> Registration:
        return Registration("", 0, self.byte_size, self.device_id, self.raw_handle)

    def status(self, name: str) -> dict[str, Any]:
        return {"name": name, "device_id": self.device_id, "byte_size": self.byte_size}

    def window(self, name: str, offset: int, byte_size: int) -> tuple[int, int]:
        return _window(name, 0, self.byte_size, offset, byte_size)

    def _opened(self, name: str) -> Any:
        with self._lock:
            if self._memory is None:
                self._memory = open_ipc_memory(name, self.raw_handle, self.device_id, self.byte_size)
            return self._memory

    def read(self, name: str, start: int, end: int) -> bytes:
        return self._opened(name).read(start, end)

    def write(self, name: str, start: int, data: bytes | memoryview) -> None:
        self._opened(name).write(start, data)


def _region_of(name: str, registration: Registration) -> _Region | _CudaRegion:
    if registration.kind == CUDA:
        return _CudaRegion(name, registration.raw_handle, registration.device_id, registration.byte_size)
    return _Region(name, registration.key, registration.offset, registration.byte_size)


class SharedMemoryRegistry:
    """Registered shared memory regions of one process, by name (system and CUDA alike).

    ``fetch`` (a model replica's) asks the ``/v2`` replica for a registration this process has
    not seen (None: there is none); without it (the ``/v2`` replica's own registry) an unknown name is Triton's
    NOT_FOUND error."""

    def __init__(self, fetch: Callable[[str], Awaitable[Registration | None]] | None = None):
        self._regions: dict[str, _Region | _CudaRegion] = {}
        self._fetch = fetch
        # Unregistrations so far: a fetch that saw one happen while it waited maps nothing.
        self._forgotten = 0

    def _check_new(self, name: str, kind: str) -> None:
        if not name:
            raise InvalidArgError(f"'region name' is necessary to register {kind} shared memory region")
        if name in self._regions:
            raise ServingError(f"shared memory region '{name}' already in manager", Code.ALREADY_EXISTS)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self._check_new(name, SYSTEM)
        if offset < 0 or byte_size < 0:
            raise InvalidArgError(f"failed to register shared memory region '{name}': invalid args")
        self._regions[name] = _Region(name, key, offset, byte_size)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Keep a CUDA region (its handle is opened where a request uses it)."""
        self._check_new(name, CUDA)
        self._regions[name] = _CudaRegion(name, raw_handle, device_id, byte_size)

    def unregister(self, name: str = "", kind: str | None = SYSTEM) -> None:
        """Forget ``name`` (every region of the kind when empty; ``kind`` None: of any kind); an
        unknown name, or one of the other kind, is no error (Triton's rule)."""
        # A mapping goes with its last reference: requests decoded against it still finish.
        self._forgotten += 1
        for region in [name] if name else list(self._regions):
            if region in self._regions and kind in (None, self._regions[region].kind):
                del self._regions[region]

    def registration(self, name: str) -> Registration:
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        return region.registration()

    def status(self, name: str = "", kind: str = SYSTEM) -> list[dict[str, Any]]:
        """Triton's status document: every region of the kind, or the one named."""
        if not name:
            return [region.status(n) for n, region in sorted(self._regions.items()) if region.kind == kind]
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find {kind} shared memory region: '{name}'")
        if region.kind != kind:
            other = {SYSTEM: "system shared memory", CUDA: "CUDA shared memory"}
            raise NotFoundError(f"The region named '{name}' is registered as {other[region.kind]}, "
                                f"not {other[kind]}")
        return [region.status(name)]

    async def fetch(self, name: str) -> None:
        """Take a region registered with the ``/v2`` replica (its NOT_FOUND error if it is not)."""
        forgotten = self._forgotten
        registration = await self._fetch(name) if self._fetch is not None else None
        if registration is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        if forgotten == self._forgotten and name not in self._regions:  # else: stale, ask again
            self._regions[name] = _region_of(name, Registration(*registration))

    def _region(self, name: str) -> _Region | _CudaRegion:
        region = self._regions.get(name)
        if region is None:
            if self._fetch is not None:
                raise RegionMissing(name)
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        return region

    def resolve(self, location: TensorLocation) -> TensorLocation:
        """``location`` with its region's mapping; the request's error if it is not inside a
        registered region."""
        region = self._region(location.region)
        region.window(location.region, location.offset, location.byte_size)
        return replace(location, mapping=region)

    def read(self, location: TensorLocation) -> bytes:
        """A copy of the tensor's bytes (the client may reuse the region once answered)."""
        region = self._region(location.region)
        return region.read(location.region, *region.window(location.region, location.offset, location.byte_size))

    def write(self, location: TensorLocation, data: bytes | memoryview, output: str) -> None:
        """Write an output's bytes; Triton's INTERNAL error when the window is too small."""
        region = location.mapping if location.mapping is not None else self._region(location.region)
        start, _ = region.window(location.region, location.offset, location.byte_size)
        if len(data) > location.byte_size:
            raise ServingError(
                f"shared memory size specified with the request for output '{output}' ({location.byte_size} bytes) "
                f"should be at least {len(data)} bytes to hold the results", Code.INTERNAL)
        region.write(location.region, start, data)


def read_input(shm: SharedMemoryRegistry | None, parameters: dict[str, Any], what: str) -> bytes | None:
    """The bytes of an input whose parameters name a region (None when they do not)."""
    location = tensor_location(parameters, what) if parameters else None
    if location is None:
        return None
    if shm is None:
        raise UnsupportedError(f"{what}: shared memory is not available here")
    return shm.read(location)


def place_output(output: Any, shm: SharedMemoryRegistry | None) -> None:
    """Move a requested output's shared memory parameters to ``output.shm``, checked against
    ``shm`` (a :class:`~rayinfer.protocol.types.RequestedOutput` with any of them)."""
    if "classification" in output.parameters:
        raise InvalidArgError("Output can't set both 'shared_memory_region' and 'classification'")
    location = tensor_location(output.parameters, f"output '{output.name}'")
    assert location is not None
    output.parameters = {k: v for k, v in output.parameters.items() if k not in TENSOR_PARAMETERS}
    if shm is None:
        raise UnsupportedError(f"output '{output.name}': shared memory is not available here")
    output.shm = shm.resolve(location)


def write_output(shm: SharedMemoryRegistry, location: TensorLocation, name: str, datatype: str,
                 data: np.ndarray) -> None:
    """Write an output to the shared memory the request named. Its response entry then carries
    no data and, as in Triton, no parameters of its own (NVIDIA's clients read any output with
    parameters as binary data)."""
    if datatype == "BYTES":
        shm.write(location, memoryview(serialize_bytes_tensor(data)), name)
    else:
        array = np.ascontiguousarray(data)
        shm.write(location, array.data.cast("B") if array.size else memoryview(b""), name)


async def decode_with_regions(registry: SharedMemoryRegistry | None, decode: Callable[[], Any]) -> Any:
    """``decode()``, fetching each region it names that this process has not mapped yet."""
    for _ in range(64):
        try:
            return decode()
        except RegionMissing as missing:
            assert registry is not None
            await registry.fetch(missing.name)
    raise InvalidArgError("a request may name at most 64 shared memory regions")
