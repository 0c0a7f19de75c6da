"""Model names as Ray Serve's applications, deployments and routes carry them: any name Triton
allows, escaped where Ray takes fewer characters, and read back."""

from __future__ import annotations

import pytest

from rayinfer.deployments.names import (
    app_model,
    deployment_version,
    model_app_name,
    model_apps,
    model_deployment_name,
    model_route_prefix,
    serve_name,
)


@pytest.mark.parametrize("name", ["simple", "a model#1", "mod\u00e8le", "twin@v2", "100%", "x_v2", "tab\tname"])
def test_every_name_round_trips_through_serves_names(name: str) -> None:
    served = serve_name(name)
    assert served.isascii() and "#" not in served and "@" not in served
    assert app_model(model_app_name(name, 3, True)) == name
    assert app_model(model_app_name(name, 2, False)) == name
    assert deployment_version(model_deployment_name(name, 7)) == 7
    assert model_apps(name, [model_app_name(name, 3, True), model_app_name(name, 2, False), "other"]) == [
        model_app_name(name, 3, True), model_app_name(name, 2, False)]


def test_common_names_are_unchanged_and_names_do_not_collide() -> None:
    assert model_app_name("resnet_50-v1.2", 1, True) == "resnet_50-v1.2"
    assert model_app_name("simple", 2, False) == "simple@v2"
    # A model named like another's version is not that version.
    assert model_apps("twin", [model_app_name("twin@v2", 1, True)]) == []
    assert serve_name("a%40b") != serve_name("a@b")


def test_route_prefixes_match_the_decoded_path_for_ascii_names() -> None:
    assert model_route_prefix("a model#1", 1, True) == "/v2/models/a model#1"
    assert model_route_prefix("mod\u00e8le", 1, True).isascii()
