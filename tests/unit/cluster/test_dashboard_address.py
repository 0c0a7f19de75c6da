"""The embedded Ray's dashboard binds 127.0.0.1 unless --dashboard-address says otherwise: its
Jobs API runs any code it is sent, so it must not follow --http-address onto every interface."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayinfer.cluster.cli import build_parser, ray_init_options, settings_from_args
from rayinfer.cluster.settings import ServerSettings

pytestmark = pytest.mark.usefixtures("cli_environment")


def settings_of(tmp_path: Path, *flags: str) -> ServerSettings:
    return settings_from_args(build_parser().parse_args(["serve", "--model-repository", str(tmp_path), *flags]))


def test_the_dashboard_binds_loopback_whatever_the_http_address(tmp_path: Path) -> None:
    options = ray_init_options(settings_of(tmp_path, "--http-address", "0.0.0.0", "--dashboard-port", "8265"))
    assert options["include_dashboard"] is True
    assert (options["dashboard_host"], options["dashboard_port"]) == ("127.0.0.1", 8265)


def test_dashboard_address_exposes_it_when_asked(tmp_path: Path) -> None:
    options = ray_init_options(settings_of(tmp_path, "--dashboard-port", "8265", "--dashboard-address", "0.0.0.0"))
    assert options["dashboard_host"] == "0.0.0.0"


def test_no_dashboard_by_default(tmp_path: Path) -> None:
    assert ray_init_options(settings_of(tmp_path))["include_dashboard"] is False
