"""The HTTP API against its OpenAPI description (docs/openapi.yaml), fuzzed with schemathesis on
the shared test server: every answer matches the documented schemas, every error is Triton's
JSON ``{"error": ...}`` with Triton's status code, no call hangs, and the server serves on
afterwards.

Bounded for CI (RAYINFER_FUZZ_EXAMPLES examples per operation, 12 by default, derandomized so a
failure reproduces); raise the variable for a longer run.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import content_type_conformance, response_schema_conformance

from conftest import http, http_json

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"
EXAMPLES = int(os.environ.get("RAYINFER_FUZZ_EXAMPLES", "12"))
# Served models, a version that does not exist, and names that are not served.
SERVED = ["batched", "simple", "nobatch", "no_such_model", "on_demand_never_loaded"]


def fuzz_document() -> dict:
    """docs/openapi.yaml with the shared server protected from the fuzzer: model names are
    served ones or unknown ones; the load and unload calls, and the rollout actions, name only
    models the repository lacks (never a served one); setting updates cannot move the server's log or trace files."""
    doc = copy.deepcopy(yaml.safe_load(SPEC.read_text()))
    doc["components"]["parameters"]["ModelName"]["schema"] = {"type": "string", "enum": SERVED}
    absent = {"name": "model_name", "in": "path", "required": True,
              "schema": {"type": "string", "pattern": "^fuzz_[a-z0-9]{1,12}$"}}
    for action in ("load", "unload"):
        doc["paths"][f"/v2/repository/models/{{model_name}}/{action}"]["post"]["parameters"] = [absent]
    rollout_action = doc["paths"]["/v2/repository/models/{model_name}/rollout/{action}"]["post"]
    rollout_action["parameters"] = [absent, rollout_action["parameters"][1]]  # never a served model's rollout
    logging_body = doc["paths"]["/v2/logging"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    del logging_body["properties"]["log_file"]
    logging_body["additionalProperties"] = False
    doc["components"]["schemas"]["TraceSettingUpdate"] = {
        "type": "object", "additionalProperties": False,
        "properties": {key: {"nullable": True, "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
                       for key in ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")},
    }
    return doc


schema = schemathesis.openapi.from_dict(fuzz_document())


@schemathesis.check
def triton_error_bodies(ctx, response, case) -> None:
    """An error is Triton's JSON body with a message (the server's and a model's readiness
    probes answer with a status only, as Triton's do)."""
    if response.status_code >= 400 and not case.path.startswith("/v2/health/") and not case.path.endswith("/ready"):
        doc = json.loads(response.text)
        assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"], response.text[:200]


@pytest.fixture(scope="module")
def settings_before(server):
    """The server's log and trace settings, put back after the fuzzer changed them."""
    saved = {path: http_json("GET", path)[1] for path in ("/v2/logging", "/v2/trace/setting")}
    yield saved
    status, _ = http_json("POST", "/v2/logging", {k: v for k, v in saved["/v2/logging"].items() if k != "log_file"})
    assert status == 200
    trace = {k: v for k, v in saved["/v2/trace/setting"].items() if k not in ("trace_file",)}
    status, _ = http_json("POST", "/v2/trace/setting", trace)
    assert status == 200
    http("POST", "/v2/systemsharedmemory/unregister")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_the_http_api_matches_its_description_under_fuzzing(case, server, settings_before):
    case.call_and_validate(base_url=f"http://{server['url']}", timeout=30,
                           checks=[triton_error_bodies, response_schema_conformance, content_type_conformance])


def test_the_server_serves_after_fuzzing(server, settings_before):
    import tritonclient.http as httpclient

    from conftest import add_sub_inputs

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with httpclient.InferenceServerClient(server["url"]) as client:
        assert client.is_server_live()
        np.testing.assert_array_equal(client.infer("batched", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2)
