"""Triton's time to first response, nv_inference_first_response_histogram_ms (--metrics-config
histogram_latencies=true): recorded per request, added up across replicas, written as Triton
writes a histogram, with a config's model_metrics buckets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.metrics import ModelFigures, render
from rayinfer.protocol.statistics import FIRST_RESPONSE_BUCKETS_MS, ModelStatistics, merge_snapshots
from rayinfer.repository.model_config import first_response_buckets

MS = 1_000_000


def histogram_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "first_response" in line]


def test_a_model_that_answers_once_counts_each_request_as_it_ends() -> None:
    stats = ModelStatistics()
    stats.record_success(40 * MS + 999_999, 0)  # whole milliseconds, rounded down: 40
    stats.record_success(100 * MS, 0)  # on a bound: in its bucket (le)
    stats.record_failure(700 * MS)  # the model's error is its response
    stats.record_failure(9000 * MS, "CANCELED")  # no response was sent
    text = render([ModelFigures("m", "1", stats.snapshot())], None, histogram_latencies=True)
    assert histogram_lines(text) == [
        "# HELP nv_inference_first_response_histogram_ms Duration from request to first response in milliseconds",
        "# TYPE nv_inference_first_response_histogram_ms histogram",
        'nv_inference_first_response_histogram_ms_bucket{model="m",version="1",le="100"} 2',
        'nv_inference_first_response_histogram_ms_bucket{model="m",version="1",le="500"} 2',
        'nv_inference_first_response_histogram_ms_bucket{model="m",version="1",le="2000"} 3',
        'nv_inference_first_response_histogram_ms_bucket{model="m",version="1",le="5000"} 3',
        'nv_inference_first_response_histogram_ms_bucket{model="m",version="1",le="+Inf"} 3',
        'nv_inference_first_response_histogram_ms_count{model="m",version="1"} 3',
        'nv_inference_first_response_histogram_ms_sum{model="m",version="1"} 840',
    ]
    assert histogram_lines(render([ModelFigures("m", "1", stats.snapshot())], None)) == []  # off by default


def test_a_decoupled_models_first_response_is_recorded_on_its_own_and_replicas_add_up() -> None:
    replicas = [ModelStatistics(first_response_buckets=(-1.0, 0.0, 1.0, 2.5), decoupled=True) for _ in range(2)]
    replicas[0].record_success(5000 * MS, 0)  # its execution ended: not its first response
    replicas[0].record_first_response(2 * MS)
    replicas[1].record_first_response(0)
    merged = merge_snapshots([r.snapshot() for r in replicas])
    lines = histogram_lines(render([ModelFigures("d", "1", merged)], None, histogram_latencies=True))
    assert [line.split("{")[1] for line in lines if "_bucket" in line] == [
        'model="d",version="1",le="-1"} 0', 'model="d",version="1",le="0"} 1', 'model="d",version="1",le="1"} 1',
        'model="d",version="1",le="2.5"} 2', 'model="d",version="1",le="+Inf"} 2']
    assert 'nv_inference_first_response_histogram_ms_sum{model="d",version="1"} 2' in lines


def config(text: str) -> mc.ModelConfig:
    return text_format.Parse('name: "m"\n' + text, mc.ModelConfig())


def test_model_metrics_gives_the_buckets_and_triton_refuses_what_it_refuses(caplog) -> None:
    path = Path("/repo/m/config.pbtxt")
    assert first_response_buckets(config(""), path) == FIRST_RESPONSE_BUCKETS_MS
    given = config('model_metrics { metric_control [ { metric_identifier { family: '
                   '"nv_inference_first_response_histogram_ms" } histogram_options { buckets: [ 1, 2, 4.5 ] } } ] }')
    assert first_response_buckets(given, path) == (1.0, 2.0, 4.5)
    other = config('model_metrics { metric_control [ { metric_identifier { family: "nv_inference_count" } '
                   'histogram_options { buckets: [ 1 ] } } ] }')
    assert first_response_buckets(other, path) == FIRST_RESPONSE_BUCKETS_MS
    assert "Metric family 'nv_inference_count' in 'metric_identifier' is not a customizable metric" in caplog.text
    for text, message in [
        ('model_metrics { metric_control [ { histogram_options { buckets: [ 1 ] } } ] }',
         "metric control must specify 'metric_identifier'"),
        ('model_metrics { metric_control [ { metric_identifier { family: "" } histogram_options { buckets: [ 1 ] } } ] }',
         "metric identifier must specify non-empty 'family'"),
        ('model_metrics { metric_control [ { metric_identifier { family: "x" } } ] }',
         "metric control must specify 'histogram_options'"),
        ('model_metrics { metric_control [ { metric_identifier { family: "x" } histogram_options { } } ] }',
         "histogram options must specify non-empty 'buckets'"),
        ('model_metrics { metric_control [ { metric_identifier { family: "nv_inference_first_response_histogram_ms" }'
         ' histogram_options { buckets: [ 5, 1 ] } } ] }', "must be strictly ascending, got [5.0, 1.0]"),
    ]:
        with pytest.raises(ModelConfigError, match=re.escape(message)) as error:
            first_response_buckets(config(text), path)
        assert str(path) in str(error.value)
