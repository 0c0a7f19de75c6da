"""The one route parser and the one request-header list (no Ray)."""

from __future__ import annotations

import pytest

from rayinfer.serving.routes import ModelRoute, keep_request_headers, parse_model_route


@pytest.mark.parametrize("path, route", [
    ("/v2/models/simple", ModelRoute("simple")),
    ("/v2/models/simple/", ModelRoute("simple")),
    ("/v2/models/simple/infer", ModelRoute("simple", "", "infer")),
    ("/v2/models/simple/versions/3/infer", ModelRoute("simple", "3", "infer")),
    ("/v2/models/simple/versions/3", ModelRoute("simple", "3")),
    ("/v2/models/simple/versions/3/ready", ModelRoute("simple", "3", "ready")),
    ("/v2/models/simple/config", ModelRoute("simple", "", "config")),
])
def test_model_routes(path: str, route: ModelRoute) -> None:
    assert parse_model_route(path) == route


def test_model_names_are_decoded_only_in_paths_as_sent() -> None:
    assert parse_model_route("/v2/models/m%C3%BC/infer", encoded=True) == ModelRoute("m\u00fc", "", "infer")
    # An ASGI scope's path is decoded already: a '%' there is part of the name.
    assert parse_model_route("/v2/models/100%25/stats") == ModelRoute("100%25", "", "stats")


@pytest.mark.parametrize("path", [
    "/v2/models/stats",  # every model's statistics
    "/v2/models/",
    "/v2/models/simple/versions",
    "/v2/models/simple/versions//infer",
    "/v2/models/simple/explain",
    "/v2/models/simple/infer/more",
    "/v2/health/ready",
])
def test_paths_that_are_not_model_routes(path: str) -> None:
    assert parse_model_route(path) is None


def test_only_the_headers_the_core_reads_are_kept() -> None:
    headers = [(b"content-encoding", b"gzip"), (b"user-agent", b"x"), (b"inference-header-content-length", b"12")]
    assert keep_request_headers(headers) == {b"content-encoding": b"gzip", b"inference-header-content-length": b"12"}
