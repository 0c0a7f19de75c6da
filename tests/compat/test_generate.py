"""Triton's generate extension (POST .../generate and .../generate_stream) through the front, with
curl and plain HTTP clients: JSON members mapped to inputs and parameters, one flat answer, server-
sent events of a decoupled model's responses, Triton's errors, cancellation by a client that goes
away, and the same statistics as infer."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

from conftest import metric_value
from waiting import wait_until

GENERATE_STREAM_EVENT = re.compile(rb"data: (.*?)\n\n", re.S)


def _post(server, path: str, doc, raw: bytes | None = None) -> tuple[int, str, bytes]:
    host, port = server["url"].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        body = raw if raw is not None else json.dumps(doc).encode()
        connection.request("POST", path, body, {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, response.getheader("content-type", ""), response.read()
    finally:
        connection.close()


def test_generate_maps_members_to_inputs_and_parameters_and_answers_one_flat_object(server):
    """py_strings (max_batch_size 4, TEXT [-1] BYTES): a list of strings is its TEXT tensor, of
    shape [1, 2]; the other members, and those of "parameters", reach the model as request
    parameters; the answer names each output, a one-element one as a plain value."""
    doc = {"TEXT": ["ab", "cd"], "stream": False, "parameters": {"temperature": 0, "tone": "loud"}, "id": "g1"}
    status, content_type, body = _post(server, "/v2/models/py_strings/generate", doc)
    assert status == 200 and content_type == "application/json", body
    answer = json.loads(body)
    assert answer["UPPER"] == ["AB!", "CD!"]
    assert (answer["model_name"], answer["model_version"], answer["id"]) == ("py_strings", "1", "g1")
    seen = json.loads(answer["SEEN"])  # one element: a JSON string, not an array
    assert seen["parameters"] == {"stream": False, "temperature": 0, "tone": "loud"}
    # A version named in the path.
    status, _, body = _post(server, "/v2/models/py_strings/versions/1/generate", {"TEXT": "x"})
    assert status == 200 and json.loads(body)["UPPER"] == "X!"


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_generate_stream_sends_each_response_of_a_decoupled_model_as_an_event(server):
    """curl -N on py_repeat: one event per element of IN, in order, then the stream ends."""
    host, port = server["url"].split(":")
    result = subprocess.run(
        ["curl", "-sN", "-i", "-X", "POST", f"http://{host}:{port}/v2/models/py_repeat/generate_stream",
         "-d", json.dumps({"IN": [4, 5, 6]})],
        capture_output=True, timeout=60, check=True,
    )
    head, _, body = result.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: text/event-stream; charset=utf-8" in head.lower(), head
    events = [json.loads(data) for data in GENERATE_STREAM_EVENT.findall(body)]
    assert [(e["OUT"], e["IDX"]) for e in events] == [(4, 0), (5, 1), (6, 2)], body
    assert all(e["model_name"] == "py_repeat" and e["model_version"] == "1" for e in events)
    # A model that is not decoupled: its one response, as an event.
    status, content_type, body = _post(server, "/v2/models/py_strings/generate_stream", {"TEXT": ["q"]})
    assert status == 200 and content_type.startswith("text/event-stream")
    (only,) = [json.loads(data) for data in GENERATE_STREAM_EVENT.findall(body)]
    assert only["UPPER"] == "Q!"


def test_generate_on_a_decoupled_model_wants_exactly_one_response(server):
    status, _, body = _post(server, "/v2/models/py_repeat/generate", {"IN": [7]})
    assert status == 200 and (json.loads(body)["OUT"], json.loads(body)["IDX"]) == (7, 0)
    status, _, body = _post(server, "/v2/models/py_repeat/generate", {"IN": [1, 2]})
    assert status == 400
    assert json.loads(body) == {"error": "generate expects model to produce exactly 1 response, use generate stream "
                                         "for model that generates various number of responses"}
    # py_cancel would stream for a minute: the answer comes at its second response.
    started = time.monotonic()
    status, _, body = _post(server, "/v2/models/py_cancel/generate", {"IN": [1]})
    assert status == 400 and "exactly 1 response" in json.loads(body)["error"]
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("path,doc,raw,status,message", [
    ("/v2/models/no_such_model/generate", {"IN": [1]}, None, 404, "no_such_model"),
    ("/v2/models/py_repeat/generate_stream", None, b"{not json", 400, "JSON"),
    ("/v2/models/py_repeat/generate", [1, 2], None, 400, "JSON object"),
    ("/v2/models/py_repeat/generate", {"IN": ["a"]}, None, 400, "input 'IN'"),
    ("/v2/models/py_repeat/generate", {"IN": [1], "parameters": 3}, None, 400, "'parameters'"),
    ("/v2/models/py_repeat/generate", {"IN": [1], "extra": [1, 2]}, None, 400, "parameter 'extra' has invalid type"),
    ("/v2/models/py_repeat/generate_stream", {"NOT_IN": 1}, None, 400, "py_repeat"),
])
def test_a_generate_request_refused_before_the_model_gets_a_json_error(server, path, doc, raw, status, message):
    answer_status, content_type, body = _post(server, path, doc, raw)
    assert answer_status == status and content_type == "application/json", body
    assert message in json.loads(body)["error"]


def test_a_client_that_goes_away_cancels_its_stream_and_the_replica_serves_on(server):
    """py_cancel streams until its request is cancelled, and counts the cancellations: a
    client that closes its generate_stream connection after the first event is one."""
    counter = 'py_cancel_cancelled{model="py_cancel"}'
    before = metric_value(server, counter)
    host, port = server["url"].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("POST", "/v2/models/py_cancel/generate_stream", json.dumps({"IN": [1]}).encode())
    response = connection.getresponse()
    assert response.status == 200
    assert response.read1(65536).startswith(b"data: {")  # the first event
    connection.sock.close()
    connection.close()
    wait_until(lambda: metric_value(server, counter) >= before + 1, "py_cancel to see its request cancelled", timeout_s=30)
    status, _, body = _post(server, "/v2/models/py_repeat/generate", {"IN": [3]})
    assert status == 200 and json.loads(body)["OUT"] == 3


def test_generate_requests_count_in_the_models_statistics(server):
    def successes() -> int:
        with urllib.request.urlopen(f"http://{server['url']}/v2/models/py_strings/stats", timeout=10) as response:
            return json.loads(response.read())["model_stats"][0]["inference_stats"]["success"]["count"]

    before = successes()
    for _ in range(3):
        assert _post(server, "/v2/models/py_strings/generate", {"TEXT": ["s"]})[0] == 200
    wait_until(lambda: successes() >= before + 3, "three generate requests in py_strings' statistics", timeout_s=30)


def test_generate_stream_on_a_connection_the_front_keeps(server):
    """A connection whose first request is the server's (liveness) stays with the front's HAProxy,
    which routes its generate_stream to a replica and streams the events back."""
    host, port = server["url"].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("GET", "/v2/health/live")
        ready = connection.getresponse()
        ready.read()
        assert ready.status == 200
        connection.request("POST", "/v2/models/py_repeat/generate_stream", json.dumps({"IN": [8, 9]}).encode())
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
        events = [json.loads(data) for data in GENERATE_STREAM_EVENT.findall(response.read())]
        assert [e["OUT"] for e in events] == [8, 9]
    finally:
        connection.close()


def test_the_example_language_model_streams_its_tokens_many_streams_at_once(server):
    """tiny_llm (the example repository's): a prompt and a seed give one text, whether it comes
    whole from generate or token by token from generate_stream, with eight streams at once."""
    from concurrent.futures import ThreadPoolExecutor

    def whole(seed: int) -> str:
        doc = {"text_input": "the movie was", "max_tokens": 6, "temperature": 0.8, "seed": seed}
        status, _, body = _post(server, "/v2/models/tiny_llm/generate", doc)
        assert status == 200, body
        return json.loads(body)["text_output"]

    def streamed(seed: int) -> list[str]:
        doc = {"text_input": "the movie was", "stream": True, "sampling_parameters": json.dumps(
            {"max_tokens": 6, "temperature": 0.8, "seed": seed})}
        status, content_type, body = _post(server, "/v2/models/tiny_llm/generate_stream", doc)
        assert status == 200 and content_type.startswith("text/event-stream"), body
        return [json.loads(data)["text_output"] for data in GENERATE_STREAM_EVENT.findall(body)]

    seeds = list(range(8))
    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(streamed, seeds))
        texts = list(pool.map(whole, seeds))
    for seed, pieces, text in zip(seeds, streams, texts):
        assert 1 <= len(pieces) <= 6 and all(piece.startswith(" ") for piece in pieces), (seed, pieces)
        assert text == "the movie was" + "".join(pieces), (seed, text, pieces)
    assert len(set(texts)) > 1  # the seed matters
    # A request's settings out of bounds: the model's error, naming the setting.
    status, _, body = _post(server, "/v2/models/tiny_llm/generate", {"text_input": "a", "max_tokens": 10**9})
    assert status == 400 and "max_tokens must be from 0 to 4096" in json.loads(body)["error"]
