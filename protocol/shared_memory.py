"""Triton's system shared memory extension: registered regions of POSIX shared memory that
requests read their inputs from and responses write their outputs to.

A client creates a shared memory object (``shm_open(key)``, which is ``/dev/shm/<key>`` on
Linux), registers a named window of it (``offset``, ``byte_size``) with the server, and then
names the region in a tensor's parameters (``shared_memory_region``,
``shared_memory_byte_size``, ``shared_memory_offset`` within the region). The memory is the
node's own: a region is usable only by processes on the client's node.

:class:`SharedMemoryRegistry` maps each region into the process that holds it. The ``/v2``
replica keeps the registrations clients make; a model replica keeps a cache that it fills on
first use (``fetch``) and empties when the ``/v2`` replica tells it a region was unregistered.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Awaitable, Callable
import stat
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rayinfer.protocol.dtypes import serialize_bytes_tensor
from rayinfer.protocol.errors import Code, InvalidArgError, NotFoundError, ServingError, UnsupportedError

# The request and response parameters of a tensor held in shared memory.
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
TENSOR_PARAMETERS = (REGION, BYTE_SIZE, OFFSET)
_SHM_DIR = "/dev/shm"

# (key, offset, byte_size) of a registration, as the ``/v2`` replica hands it to a model replica.
Registration = tuple[str, int, int]


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
    values = []
    for field in ("offset", "byte_size"):
        value = doc.get(field, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgError(f"Unable to parse '{field}': expected a JSON unsigned integer")
        values.append(value)
    return key, values[0], values[1]


def shm_path(key: str) -> str:
    """The file ``shm_open(key)`` names; a key that is not one name is refused (no paths)."""
    name = key[1:] if key.startswith("/") else key
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ServingError(f"Unable to open shared memory region: '{key}'", Code.INTERNAL)
    return os.path.join(_SHM_DIR, name)


class _Region:
    """One registered region mapped into this process (the file's first offset + byte_size bytes)."""

    __slots__ = ("key", "offset", "byte_size", "_map")

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

    def window(self, name: str, offset: int, byte_size: int) -> tuple[int, int]:
        """[start, end) in the mapping of ``byte_size`` bytes at ``offset`` in the region,
        with Triton's checks and messages."""
        if offset >= self.byte_size:
            raise InvalidArgError(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > self.byte_size:
            raise InvalidArgError(f"Invalid offset + byte size for shared memory region: '{name}'")
        start = self.offset + offset
        return start, start + byte_size

    def read(self, start: int, end: int) -> bytes:
        return self._map[start:end]

    def write(self, start: int, data: bytes | memoryview) -> None:
        self._map[start:start + len(data)] = data



class SharedMemoryRegistry:
    """Registered system shared memory regions of one process, by name.

    ``fetch`` (a model replica's) asks the ``/v2`` replica for a registration this process has
    not seen (None: there is none); without it (the ``/v2`` replica's own registry) an unknown name is Triton's
    NOT_FOUND error."""

    def __init__(self, fetch: Callable[[str], Awaitable[Registration | None]] | None = None):
        self._regions: dict[str, _Region] = {}
        self._fetch = fetch
        # Unregistrations so far: a fetch that saw one happen while it waited maps nothing.
        self._forgotten = 0

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgError("'region name' is necessary to register system shared memory region")
        if name in self._regions:
            raise ServingError(f"shared memory region '{name}' already in manager", Code.ALREADY_EXISTS)
        if offset < 0 or byte_size < 0:
            raise InvalidArgError(f"failed to register shared memory region '{name}': invalid args")
        self._regions[name] = _Region(name, key, offset, byte_size)

    def unregister(self, name: str = "") -> None:
        """Forget ``name`` (every region when empty); an unknown name is no error (Triton's rule)."""
        # A mapping goes with its last reference: requests decoded against it still finish.
        self._forgotten += 1
        if name:
            self._regions.pop(name, None)
        else:
            self._regions.clear()

    def registration(self, name: str) -> Registration:
        region = self._regions.get(name)
        if region is None:
            raise NotFoundError(f"Unable to find system shared memory region: '{name}'")
        return region.key, region.offset, region.byte_size

    def status(self, name: str = "") -> list[dict[str, Any]]:
        """Triton's status document: every region, or the one named."""
        names = [name] if name else sorted(self._regions)
        if name:
            self.registration(name)  # Triton's NOT_FOUND for an unknown name
        return [{"name": n, "key": self._regions[n].key, "offset": self._regions[n].offset,
                 "byte_size": self._regions[n].byte_size} for n in names]

    async def fetch(self, name: str) -> None:
        """Map a region registered with the ``/v2`` replica (its NOT_FOUND error if it is not)."""
        forgotten = self._forgotten
        registration = await self._fetch(name) if self._fetch is not None else None
        if registration is None:
            raise NotFoundError(f"Unable to find shared memory region: '{name}'")
        key, offset, byte_size = registration
        if forgotten == self._forgotten and name not in self._regions:  # else: stale, ask again
            self._regions[name] = _Region(name, key, offset, byte_size)

    def _region(self, name: str) -> _Region:
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
        return region.read(*region.window(location.region, location.offset, location.byte_size))

    def write(self, location: TensorLocation, data: bytes | memoryview, output: str) -> None:
        """Write an output's bytes; Triton's INTERNAL error when the window is too small."""
        region = location.mapping if location.mapping is not None else self._region(location.region)
        start, _ = region.window(location.region, location.offset, location.byte_size)
        if len(data) > location.byte_size:
            raise ServingError(
                f"shared memory size specified with the request for output '{output}' ({location.byte_size} bytes) "
                f"should be at least {len(data)} bytes to hold the results", Code.INTERNAL)
        region.write(start, data)

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
