"""The ``/v2`` replica's writing of Triton's JSON trace files: the traces model replicas took,
numbered (a step's trace names its ensemble's id as ``parent_id``, whichever arrives first) and
written as each model's settings say, a gRPC stream request's joined with the send stamps of its
responses, which the ``/v2`` replica takes itself."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)

# How many trace tokens the writer remembers the ids of (traces of one request arrive within
# seconds of each other).
_KEPT_IDS = 65536
# How long a stream request's trace waits in the /v2 replica for the send stamps of its responses
# (or those stamps for their trace) before it is written without them: the client went away.
_SEND_WAIT_S = 30.0


class TraceWriter:
    """Numbers the traces replicas took and writes Triton's JSON trace files: every
    ``log_frequency`` traces to ``<file>.<n>`` (n from 0), or, with 0, all of them to ``<file>``
    when the server stops (:meth:`close`)."""

    def __init__(self) -> None:
        self._next_id = 1
        # Trace tokens -> the ids given them: a step's trace may arrive before or after its
        # ensemble's (replicas report on their own), and both must name the same id.
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._file_index: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # traces pending per file
        self._frequency: dict[str, int] = {}  # the log frequency last in effect per file
        # A stream request's trace and the send stamps of its responses, whichever came first
        # (by token, oldest first): (when it came, the trace and its settings, or the stamps).
        self._awaiting_sends: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
        self._sends: dict[str, tuple[float, list[tuple[str, int]]]] = {}

    def add(self, traces: list[dict[str, Any]], settings: dict[str, Any]) -> None:
        """Traces a replica took, written as the settings say; a stream request's
        (``awaits_send``) once the send stamps of its responses are here (:meth:`sent`)."""
        for trace in traces:
            if trace.get("awaits_send"):
                sends = self._sends.pop(trace["token"], None)
                if sends is None:
                    self._awaiting_sends[trace["token"]] = (time.monotonic(), trace, settings)
                    continue
                trace = _with_sends(trace, sends[1])
            self._add(trace, settings)
        self._expire()

    def sent(self, token: str, stamps: list[tuple[str, int]]) -> None:
        """When the responses of the stream request traced as ``token`` were written (Triton's
        GRPC_SEND_START and _END of each, on the model replica's clock), by the ``/v2`` replica."""
        waiting = self._awaiting_sends.pop(token, None)
        if waiting is None:
            self._sends[token] = (time.monotonic(), stamps)
        else:
            self._add(_with_sends(waiting[1], stamps), waiting[2])
        self._expire()

    def _expire(self, wait_s: float = _SEND_WAIT_S) -> None:
        """Write the stream traces that waited ``wait_s`` for their send stamps without them, and
        drop stamps whose trace did not come (a replica that died)."""
        before = time.monotonic() - wait_s
        while self._awaiting_sends:
            token, (since, trace, settings) = next(iter(self._awaiting_sends.items()))
            if since > before:
                break
            del self._awaiting_sends[token]
            self._add(trace, settings)
        while self._sends and next(iter(self._sends.values()))[0] <= before:
            del self._sends[next(iter(self._sends))]

    def _add(self, trace: dict[str, Any], settings: dict[str, Any]) -> None:
        path = settings["trace_file"]
        if not path:
            return
        frequency = int(settings["log_frequency"])
        self._frequency[path] = frequency
        pending = self._pending.setdefault(path, [])
        pending.extend(self._entries(trace))
        self._counts[path] = count = self._counts.get(path, 0) + 1
        if frequency > 0 and count >= frequency:
            self._flush(path)

    def _flush(self, path: str) -> None:
        """Write ``path``'s pending traces: to ``<path>.<n>`` with a log frequency, else ``<path>``."""
        if self._frequency.get(path, 0) > 0:
            index = self._file_index.get(path, 0)
            self._file_index[path] = index + 1
            _write(f"{path}.{index}", self._pending[path])
        else:
            _write(path, self._pending[path])
        self._pending[path], self._counts[path] = [], 0

    def _id(self, token: str | None) -> int:
        """The id of the trace ``token`` names (a new one for a new token or none)."""
        trace_id = self._ids.get(token) if token else None
        if trace_id is None:
            trace_id = self._next_id
            self._next_id += 1
            if token:
                self._ids[token] = trace_id
                if len(self._ids) > _KEPT_IDS:
                    self._ids.popitem(last=False)
        return trace_id

    def _entries(self, trace: dict[str, Any]) -> list[dict[str, Any]]:
        parent = trace.get("parent")
        parent_id = self._id(parent) if parent else 0  # before the child's: a parent's id is lower
        trace_id = self._id(trace.get("token"))
        entries = [{"id": trace_id, "model_name": trace["model_name"], "model_version": trace["model_version"],
                    "request_id": trace["request_id"], "parent_id": parent_id}]
        entries += [{"id": trace_id, **tensor} for tensor in trace["tensors"]]
        if trace["timestamps"]:
            entries.append({"id": trace_id, "timestamps": [{"name": n, "ns": ns} for n, ns in trace["timestamps"]]})
        return entries

    def close(self) -> None:
        """Write what is pending (the server stops), stream traces still waiting for their send
        stamps included."""
        self._expire(wait_s=float("-inf"))
        for path, pending in list(self._pending.items()):
            if pending:
                self._flush(path)


def _with_sends(trace: dict[str, Any], stamps: list[tuple[str, int]]) -> dict[str, Any]:
    """A stream request's trace with the send stamps of its responses, in time order."""
    return {**trace, "timestamps": sorted([*trace["timestamps"], *stamps], key=lambda s: s[1])}


def _write(path: str, entries: list[dict[str, Any]]) -> None:
    """Write ``path`` whole or not at all: a reader never sees it empty or half written (the
    entries go to a hidden file beside it, which then takes its name)."""
    folder, name = os.path.split(path)
    partial = os.path.join(folder, f".{name}.{os.getpid()}.partial")
    try:
        with open(partial, "w") as file:
            json.dump(entries, file)
        os.replace(partial, path)
    except OSError as exc:  # the traces are lost; the server keeps serving
        logger.error("could not write the trace file %s: %s", path, exc)
