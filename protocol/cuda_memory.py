"""CUDA device memory another process shares through a CUDA IPC handle (Triton's CUDA shared
memory extension), read and written with the CUDA driver API (``libcuda.so.1``, which every
machine with an NVIDIA driver has; no CUDA toolkit or Python package is needed).

A client allocates device memory, takes its ``cudaIpcMemHandle_t`` (64 bytes) and registers it
with the device's id. A process that opens the handle sees the same memory: inputs are copied
from it to the host, outputs from the host to it (synchronous copies, small next to a model's
run). The handle is opened on the device the client named, as this process numbers it:
``CUDA_VISIBLE_DEVICES`` (which Ray sets for a replica given GPUs) maps the client's device id
to the process's ordinal.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from rayinfer.protocol.errors import InvalidArgError

IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(CUipcMemHandle)
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def ipc_handle(raw_handle: bytes) -> _IpcHandle:
    """The handle as the driver takes it (by value), every byte kept: a ``c_char`` array set
    from bytes would stop at the first zero byte."""
    return _IpcHandle.from_buffer_copy(raw_handle)


# The entry points cuda.h maps these names to (the others are exported as named).
_SYMBOLS = {name: name + "_v2" for name in ("cuCtxPushCurrent", "cuCtxPopCurrent", "cuIpcOpenMemHandle",
                                            "cuMemGetAddressRange", "cuMemcpyDtoH", "cuMemcpyHtoD")}


class CudaUnavailableError(Exception):
    """This process cannot reach the device: no driver, or the device is not visible here."""


class _Driver:
    """The few driver calls CUDA shared memory needs, each device's primary context retained
    once per process (the context torch and onnxruntime use too)."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise CudaUnavailableError(f"no CUDA driver on this node ({exc})") from None
        self._call("cuInit", 0)
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self._lock = threading.Lock()

    def _function(self, name: str) -> Any:
        symbol = _SYMBOLS.get(name, name)
        function = getattr(self._lib, symbol, None)
        if function is None:
            raise CudaUnavailableError(f"the CUDA driver has no {symbol}")
        return function

    def _call(self, name: str, *args: Any) -> None:
        result = self._function(name)(*args)
        if result != 0:
            message = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(message))
            text = message.value.decode() if message.value else f"CUDA error {result}"
            raise CudaUnavailableError(f"{name}: {text}")

    def context(self, ordinal: int) -> ctypes.c_void_p:
        with self._lock:
            if ordinal not in self._contexts:
                device = ctypes.c_int()
                self._call("cuDeviceGet", ctypes.byref(device), ordinal)
                context = ctypes.c_void_p()
                self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
                self._contexts[ordinal] = context
            return self._contexts[ordinal]

    def run(self, ordinal: int, name: str, *args: Any) -> None:
        """``name(*args)`` with the device's context current in this thread (and the thread's own
        context back afterwards)."""
        self._call("cuCtxPushCurrent", self.context(ordinal))
        try:
            self._call(name, *args)
        finally:
            self._call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def _the_driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def local_ordinal(device_id: int, visible: str | None = None) -> int:
    """The ordinal this process gives the client's device ``device_id`` (``CUDA_VISIBLE_DEVICES``
    renumbers devices). A device it does not list (or listed by UUID) is tried from the first
    visible one: the driver opens handles of devices a process does not see, through peer
    access. CudaUnavailableError where no device is visible at all (Ray's setting for a replica
    without GPUs)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return device_id
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if not devices:
        raise CudaUnavailableError(f"no GPU is visible to this process (CUDA_VISIBLE_DEVICES='{visible}'); serve the "
                              "model on GPU instances (instance_group KIND_GPU)")
    return devices.index(str(device_id)) if str(device_id) in devices else 0


class CudaIpcMemory:
    """Device memory opened from a CUDA IPC handle: ``byte_size`` bytes at its start, copied to
    and from host buffers. Closed when the object goes (requests decoded against it hold it)."""

    def __init__(self, raw_handle: bytes, device_id: int, byte_size: int):
        self._ordinal = local_ordinal(device_id)  # first: a replica without GPUs is told so
        self._driver = _the_driver()
        self._pointer = ctypes.c_uint64()
        handle = ipc_handle(raw_handle)
        self._driver.run(self._ordinal, "cuIpcOpenMemHandle", ctypes.byref(self._pointer), handle,
                         ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        try:
            self._driver.run(self._ordinal, "cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size),
                             self._pointer)
            if byte_size > size.value - (self._pointer.value - base.value):
                raise CudaUnavailableError(f"the allocation holds {size.value} bytes, fewer than byte_size {byte_size}")
        except CudaUnavailableError:
            self.close()
            raise

    def read(self, start: int, end: int) -> bytes:
        buffer = ctypes.create_string_buffer(end - start)
        if end > start:
            self._driver.run(self._ordinal, "cuMemcpyDtoH", buffer, ctypes.c_uint64(self._pointer.value + start),
                             ctypes.c_size_t(end - start))
        return buffer.raw

    def write(self, start: int, data: bytes | memoryview) -> None:
        if not len(data):
            return
        source = (ctypes.c_char * len(data)).from_buffer_copy(data)
        self._driver.run(self._ordinal, "cuMemcpyHtoD", ctypes.c_uint64(self._pointer.value + start), source,
                         ctypes.c_size_t(len(data)))
        # A copy from pageable memory may still be in flight when cuMemcpyHtoD returns: the
        # client reads the output as soon as the response arrives. Only the copy's (legacy
        # default) stream is waited for, not the models' work on other streams.
        self._driver.run(self._ordinal, "cuStreamSynchronize", None)

    def close(self) -> None:
        if self._pointer.value:
            pointer, self._pointer = self._pointer, ctypes.c_uint64()
            self._driver.run(self._ordinal, "cuIpcCloseMemHandle", pointer)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # a process shutting down may have lost the driver first
            pass


def open_ipc_memory(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> CudaIpcMemory:
    """Open a registered region's handle; Triton's INVALID_ARG error naming the region when this
    process cannot."""
    try:
        return CudaIpcMemory(raw_handle, device_id, byte_size)
    except CudaUnavailableError as exc:
        raise InvalidArgError(f"Unable to open CUDA shared memory region '{name}' on GPU {device_id}: {exc}") from None
