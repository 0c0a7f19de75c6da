"""tritonserver's ``--http-restricted-api`` and ``--grpc-restricted-protocol``: groups of
endpoints answered only to requests that carry a given header with a given value.

A flag's value is ``<group>[,<group>...]:<key>=<value>``; it may be given again for other groups
(each group in one flag at most). Over HTTP a request without the header gets 403 and
``{"error": "This API is restricted, expecting header '<key>'"}``; over gRPC the header is
``triton-grpc-protocol-<key>`` and a call without it fails with UNAVAILABLE, as in Triton.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

GROUPS = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository", "statistics",
          "trace", "logging")
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
# Header names are HTTP tokens; values are kept to what a config line carries unquoted.
_KEY = re.compile(r"[A-Za-z0-9!#$&'*+.^_`|~-]+")
_VALUE = re.compile(r"[A-Za-z0-9!#$&*+./:;<>?@^_`|~=-]+")

_M = "/v2/models/[^/]+(/versions/[^/]+)?"
# HTTP paths of each group (regular expressions HAProxy matches against the path).
HTTP_PATHS: dict[str, tuple[str, ...]] = {
    "health": ("^/v2/health(/.*)?$", f"^{_M}/ready/*$"),
    "metadata": ("^/v2/*$", f"^{_M}/*$"),
    "inference": (f"^{_M}/(infer|generate|generate_stream)/*$",),
    "shared-memory": ("^/v2/(system|cuda)sharedmemory(/.*)?$",),
    "model-config": (f"^{_M}/config/*$",),
    "model-repository": ("^/v2/repository(/.*)?$",),
    "statistics": ("^/v2/models/stats/*$", f"^{_M}/stats/*$"),
    "trace": ("^/v2/trace/setting/*$", f"^{_M}/trace/setting/*$"),
    "logging": ("^/v2/logging/*$",),
}
# The OpenAI-compatible API's paths in each group (as Triton's OpenAI frontend groups them); a
# request without the header gets 401 and OpenAI's error there, as from that frontend.
OPENAI_PATHS: dict[str, tuple[str, ...]] = {
    "inference": ("^/v1/(chat/completions|completions|embeddings)/*$",),
    "model-repository": ("^/v1/models(/.*)?$",),
}
# Paths a group's patterns match that belong to another group.
HTTP_EXCLUDED: dict[str, str] = {"metadata": "^/v2/models/stats/*$"}
# GRPCInferenceService's methods in each group.
GRPC_METHODS: dict[str, tuple[str, ...]] = {
    "health": ("ServerLive", "ServerReady", "ModelReady"),
    "metadata": ("ServerMetadata", "ModelMetadata"),
    "inference": ("ModelInfer", "ModelStreamInfer"),
    "shared-memory": ("SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                      "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister"),
    "model-config": ("ModelConfig",),
    "model-repository": ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
    "statistics": ("ModelStatistics",),
    "trace": ("TraceSetting",),
    "logging": ("LogSettings",),
}

# {group: (header key, value)}
Restrictions = dict[str, tuple[str, str]]


def parse_restrictions(values: list[str], flag: str) -> Restrictions:
    """The groups the flag's values restrict; ValueError with tritonserver's message (``flag``:
    ``--http-restricted-api`` or ``--grpc-restricted-protocol``)."""
    what = "api" if "api" in flag else "protocol"
    restrictions: Restrictions = {}
    for value in values:
        groups, colon, setting = value.partition(":")
        key, equals, expected = setting.partition("=")
        if not (colon and equals and groups and key):
            raise ValueError(f"{flag} option format is '<config name>:<setting>=<value>'. Got {value}")
        if not _KEY.fullmatch(key) or not _VALUE.fullmatch(expected):
            raise ValueError(f"{flag}: the header '{key}' and its value '{expected}' must be plain HTTP tokens "
                             "(no spaces or quotes)")
        for group in groups.split(","):
            if group not in GROUPS:
                raise ValueError(f"unknown restricted {what} '{group}'")
            if group in restrictions:
                raise ValueError(f"restricted {what} '{group}' can not be specified in multiple config groups")
            restrictions[group] = (key, expected)
    return restrictions


_HTTP_GROUPS = [(group, re.compile("|".join(f"(?:{p})" for p in patterns))) for group, patterns in HTTP_PATHS.items()]
_HTTP_EXCLUDED = {group: re.compile(pattern) for group, pattern in HTTP_EXCLUDED.items()}
_GRPC_GROUPS = {method: group for group, methods in GRPC_METHODS.items() for method in methods}


def http_group(path: str) -> str | None:
    """The endpoint group of an HTTP request's path (None: none's)."""
    for group, pattern in _HTTP_GROUPS:
        excluded = _HTTP_EXCLUDED.get(group)
        if pattern.match(path) and not (excluded is not None and excluded.match(path)):
            return group
    return None


def grpc_group(method: str) -> str | None:
    """The endpoint group of a GRPCInferenceService method (None: none's)."""
    return _GRPC_GROUPS.get(method)


def header_names(http: Restrictions, grpc: Restrictions) -> frozenset[bytes]:
    """The headers (lower case) the restricted groups' requests must carry."""
    names = {key.lower() for key, _ in http.values()} | {f"{GRPC_HEADER_PREFIX}{key}".lower() for key, _ in grpc.values()}
    return frozenset(name.encode() for name in names)


def inference_headers(http: Restrictions) -> tuple[tuple[bytes, bytes], ...]:
    """The header a replica's own inference calls to other replicas' listeners carry (an
    ensemble's steps, a sequence's request sent on) when the ``inference`` group is restricted."""
    if "inference" not in http:
        return ()
    key, value = http["inference"]
    return ((key.lower().encode(), value.encode()),)


def missing_header(http: Restrictions, grpc: Restrictions, path: str, headers: Mapping[bytes, bytes],
                   service_path: str) -> str | None:
    """The key of the header a request to ``path`` lacks (or carries with another value) when
    its group is restricted, else None; ``headers``: lower-case names; a path under
    ``service_path`` is a gRPC call."""
    if path.startswith(service_path):
        restrictions, group, prefix = grpc, grpc_group(path[len(service_path):]), GRPC_HEADER_PREFIX
    else:
        restrictions, group, prefix = http, http_group(path), ""
    if group is None or group not in restrictions:
        return None
    key, value = restrictions[group]
    return None if headers.get(f"{prefix}{key}".lower().encode()) == value.encode() else key


_OPENAI_GROUPS = [(group, re.compile("|".join(f"(?:{p})" for p in patterns)))
                  for group, patterns in OPENAI_PATHS.items()]


def missing_openai_header(http: Restrictions, method: str, path: str, headers: Mapping[bytes, bytes]) -> str | None:
    """As :func:`missing_header`, for the OpenAI-compatible API's paths (``method`` is not
    looked at: each path belongs to one group whatever the method)."""
    for group, pattern in _OPENAI_GROUPS:
        if group in http and pattern.match(path):
            key, value = http[group]
            return None if headers.get(key.lower().encode()) == value.encode() else key
    return None


def openai_message(key: str) -> str:
    return f"This API is restricted, expecting header '{key}' with valid value"


def openai_restricted_document(key: str) -> dict[str, dict[str, str | None]]:
    """OpenAI's error answering a restricted path's request without its header (status 401)."""
    return {"error": {"message": openai_message(key), "type": "authentication_error", "param": None,
                      "code": "invalid_auth"}}


def http_message(key: str) -> str:
    return f"This API is restricted, expecting header '{key}'"


def grpc_message(key: str) -> str:
    return f"This protocol is restricted, expecting header '{GRPC_HEADER_PREFIX}{key}'"
