"""Triton's Prometheus text from statistics snapshots, and the /proc CPU sampler."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from rayinfer.protocol.host_figures import CpuFigures, CpuSampler, GpuFigures, GpuSampler
from rayinfer.protocol.metrics import CacheFigures, ModelFigures, render
from rayinfer.protocol.statistics import ModelStatistics, merge_snapshots


def figures() -> ModelFigures:
    stats = ModelStatistics()
    stats.record_execution(requests=2, rows=5, input_ns=1_000, infer_ns=40_000, output_ns=2_000)
    stats.record_success(request_ns=90_500, queue_ns=3_000)
    stats.record_success(request_ns=60_000, queue_ns=1_999)
    stats.record_failure(request_ns=10)
    return ModelFigures("my_model", "1", stats.snapshot(), pending=4)


def test_failures_are_labelled_with_their_reason():
    stats = ModelStatistics()
    stats.record_failure(request_ns=10)
    stats.record_failure(request_ns=10, reason="REJECTED")
    stats.record_failure(request_ns=10, reason="REJECTED")
    other = ModelStatistics()  # a second replica's
    other.record_failure(request_ns=10, reason="REJECTED")
    snapshot = merge_snapshots([stats.snapshot(), other.snapshot()])
    lines = render([ModelFigures("m", "1", snapshot, pending=0)], None).splitlines()
    assert 'nv_inference_request_failure{model="m",reason="BACKEND",version="1"} 1' in lines
    assert 'nv_inference_request_failure{model="m",reason="REJECTED",version="1"} 3' in lines
    assert 'nv_inference_request_failure{model="m",reason="CANCELED",version="1"} 0' in lines


def test_render_uses_triton_names_labels_and_microseconds():
    text = render([figures()], CpuFigures(0.25, 1000, 400))
    lines = text.splitlines()
    assert "# HELP nv_inference_request_success Number of successful inference requests, all batch sizes" in lines
    assert "# TYPE nv_inference_request_success counter" in lines
    assert 'nv_inference_request_success{model="my_model",version="1"} 2' in lines
    assert 'nv_inference_request_failure{model="my_model",reason="BACKEND",version="1"} 1' in lines
    assert 'nv_inference_request_failure{model="my_model",reason="REJECTED",version="1"} 0' in lines
    assert 'nv_inference_count{model="my_model",version="1"} 5' in lines
    assert 'nv_inference_exec_count{model="my_model",version="1"} 1' in lines
    assert 'nv_inference_request_duration_us{model="my_model",version="1"} 150' in lines
    assert 'nv_inference_queue_duration_us{model="my_model",version="1"} 4' in lines
    # Each of the 2 requests is charged the execution's time, as in the statistics extension.
    assert 'nv_inference_compute_infer_duration_us{model="my_model",version="1"} 80' in lines
    assert "# TYPE nv_inference_pending_request_count gauge" in lines
    assert 'nv_inference_pending_request_count{model="my_model",version="1"} 4' in lines
    assert "nv_cpu_utilization 0.25" in lines
    assert "nv_cpu_memory_total_bytes 1000" in lines
    assert "nv_cpu_memory_used_bytes 400" in lines
    assert text.endswith("\n")


def test_render_without_models_or_cpu_still_declares_the_families():
    text = render([], None)
    assert "# TYPE nv_inference_count counter" in text
    assert "nv_cpu" not in text


def test_label_values_are_escaped():
    text = render([ModelFigures('we"ird\\name\nnext', "2", ModelStatistics().snapshot())], None)
    assert 'nv_inference_count{model="we\\"ird\\\\name\\nnext",version="2"} 0' in text.splitlines()


def test_numbers_are_spelled_as_triton_spells_them():
    class Gauges:
        def collect(self) -> list[Metric]:
            family = GaugeMetricFamily("custom_values", "Values", labels=["kind"])
            for kind, number in [("int", 2.0), ("big", 2.0**70), ("fraction", 0.1), ("negative", -3.0),
                                 ("inf", float("inf")), ("minus_inf", float("-inf")), ("nan", float("nan"))]:
                family.add_metric([kind], number)
            return [family]

    lines = render([], None, extra=[Gauges()]).splitlines()
    assert lines[-7:] == [
        'custom_values{kind="int"} 2', 'custom_values{kind="big"} 1.1805916207174113e+21',
        'custom_values{kind="fraction"} 0.1', 'custom_values{kind="negative"} -3',
        'custom_values{kind="inf"} +Inf', 'custom_values{kind="minus_inf"} -Inf', 'custom_values{kind="nan"} NaN',
    ]


class BackendMetrics:
    """Stands in for a Python backend's custom metrics: prometheus_client's own counter (samples
    named ``<name>_total``), a counter with Triton's naming, a gauge and a histogram."""

    def collect(self) -> list[Metric]:
        requests = CounterMetricFamily("custom_requests", "Requests the model saw", labels=["model"])
        requests.add_metric(["my_model"], 3)
        triton_style = Metric("custom_batches", "Batches the model ran", "counter")
        triton_style.add_sample("custom_batches", {"model": "my_model"}, 7)
        latency = HistogramMetricFamily("custom_latency_s", "Request latency", labels=["model"])
        latency.add_metric(["my_model"], buckets=[("0.1", 1), ("+Inf", 2)], sum_value=0.25)
        return [requests, triton_style, GaugeMetricFamily("custom_temperature", "Degrees", value=21.5), latency]


def declared_families(text: str) -> dict[str, str]:
    """Each family's TYPE by its declared name, checking that every sample line belongs to the
    family declared above it (its exact name, or a histogram's ``_bucket``/``_sum``/``_count``)."""
    families: dict[str, str] = {}
    name = kind = ""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:]
            families[name] = kind
        elif not line.startswith("#"):
            sample = line.split("{")[0].split()[0]
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ()
            assert sample == name or sample in {name + s for s in suffixes}, line
    return families


def test_extra_collectors_join_tritons_families_and_counters_keep_tritons_names():
    text = render([figures()], CpuFigures(0.25, 1000, 400), extra=[BackendMetrics()])
    lines = text.splitlines()
    families = declared_families(text)
    assert [name for name, kind in families.items() if name.startswith("nv_inference") and kind == "counter"] == [
        "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
        "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ]
    assert not any(name.startswith("nv_") and name.endswith("_total") for name in families)
    # The backend's families come after Triton's, each declared as its samples are named.
    assert list(families)[-4:] == ["custom_requests_total", "custom_batches", "custom_temperature", "custom_latency_s"]
    assert 'custom_requests_total{model="my_model"} 3' in lines
    assert "# TYPE custom_batches counter" in lines
    assert 'custom_batches{model="my_model"} 7' in lines
    assert "custom_temperature 21.5" in lines
    assert 'custom_latency_s_bucket{model="my_model",le="+Inf"} 2' in lines
    assert 'custom_latency_s_sum{model="my_model"} 0.25' in lines


def test_an_extra_collectors_histogram_renders_its_buckets_sum_and_count():
    backend = CollectorRegistry()
    latency = Histogram("custom_wait_s", "Wait", ["model"], buckets=(0.1, 1.0), registry=backend)
    latency.labels("my_model").observe(0.25)
    latency.labels("my_model").observe(3)
    text = render([], None, extra=[backend])
    lines = text.splitlines()
    families = declared_families(text)
    assert families["custom_wait_s"] == "histogram"
    assert lines[lines.index("# TYPE custom_wait_s histogram") + 1:][:5] == [
        'custom_wait_s_bucket{model="my_model",le="0.1"} 0',
        'custom_wait_s_bucket{model="my_model",le="1.0"} 1',
        'custom_wait_s_bucket{model="my_model",le="+Inf"} 2',
        'custom_wait_s_count{model="my_model"} 2',
        'custom_wait_s_sum{model="my_model"} 3.25',
    ]
    # Its creation time (unless PROMETHEUS_DISABLE_CREATED_SERIES) is a gauge family of its own, as
    # generate_latest writes it.
    assert families.get("custom_wait_s_created", "gauge") == "gauge"


def test_an_extra_collector_that_clashes_with_tritons_names_is_refused():
    class Clashing:
        def describe(self) -> list[Metric]:
            return [CounterMetricFamily("nv_inference_count", "Not Triton's")]

        def collect(self) -> list[Metric]:
            return self.describe()

    with pytest.raises(ValueError, match="nv_inference_count"):
        render([figures()], None, extra=[Clashing()])


def write_proc(root: Path, busy: int, idle: int) -> None:
    root.mkdir(exist_ok=True)
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    (root / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    600 kB\n")


def test_cpu_sampler_reports_utilization_between_samples_and_memory(tmp_path: Path):
    proc = tmp_path / "proc"
    write_proc(proc, busy=100, idle=300)
    sampler = CpuSampler(proc)
    first = sampler.sample()
    assert first == CpuFigures(0.0, 1_024_000, 409_600)
    write_proc(proc, busy=175, idle=325)  # 75 busy of 100 ticks
    assert sampler.sample().utilization == 0.75


def test_cpu_sampler_without_proc_reports_nothing(tmp_path: Path):
    assert CpuSampler(tmp_path / "missing").sample() is None


def test_render_gpu_families_with_triton_names_and_gpu_uuid_labels():
    full = GpuFigures("GPU-a1", 0.5, 80 * 2**30, 2**30, 71.5, 300.0, 12.25)
    partial = GpuFigures("GPU-b2", 0.0, 16 * 2**30, 0, None, None, None)  # no power readings
    lines = render([], None, (full, partial)).splitlines()
    assert "# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)" in lines
    assert "# TYPE nv_gpu_utilization gauge" in lines
    assert 'nv_gpu_utilization{gpu_uuid="GPU-a1"} 0.5' in lines
    assert 'nv_gpu_utilization{gpu_uuid="GPU-b2"} 0' in lines
    assert f'nv_gpu_memory_total_bytes{{gpu_uuid="GPU-a1"}} {80 * 2**30}' in lines
    assert f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-a1"}} {2**30}' in lines
    assert 'nv_gpu_power_usage{gpu_uuid="GPU-a1"} 71.5' in lines
    assert 'nv_gpu_power_limit{gpu_uuid="GPU-a1"} 300' in lines
    assert "# TYPE nv_energy_consumption counter" in lines
    assert 'nv_energy_consumption{gpu_uuid="GPU-a1"} 12.25' in lines
    assert not any(line.startswith("nv_gpu_power_usage{gpu_uuid=\"GPU-b2\"}") for line in lines)


def test_no_gpu_families_without_gpus():
    assert "nv_gpu" not in render([], CpuFigures(0.1, 10, 5))


def nvml_devices() -> int:
    if importlib.util.find_spec("pynvml") is None:
        return 0
    import pynvml

    try:
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return 0


HAS_GPU = nvml_devices() > 0


def test_gpu_sampler_sees_the_gpus_nvml_sees_and_none_without():
    sampler = GpuSampler()
    assert sampler.device_count == nvml_devices()
    assert len(sampler.sample()) == sampler.device_count  # () without NVML or a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU and nvidia-ml-py (the gpu extra)")
def test_gpu_sampler_reads_every_gpu_of_the_node():
    sampler = GpuSampler()
    figures = sampler.sample()
    assert len(figures) == sampler.device_count == nvml_devices()
    for gpu in figures:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.memory_total_bytes > 0 and 0 <= gpu.memory_used_bytes <= gpu.memory_total_bytes
        assert gpu.utilization is not None and 0.0 <= gpu.utilization <= 1.0
        assert gpu.energy_j is None or gpu.energy_j >= 0.0
    text = render([], None, figures)
    assert f'nv_gpu_memory_total_bytes{{gpu_uuid="{figures[0].uuid}"}} {figures[0].memory_total_bytes}' in text


def test_the_response_cache_has_tritons_per_model_and_server_wide_families():
    stats = ModelStatistics()
    stats.record_cache_miss(40_000)
    stats.record_cache_hit(60_000, 20_000)
    stats.record_cache_hit(60_000, 22_000)
    cached = {**stats.snapshot(), "response_cache": True}
    plain = ModelStatistics().snapshot()
    text = render([ModelFigures("c", "1", cached), ModelFigures("p", "1", plain)], None,
                  cache=CacheFigures(1000, 250, 3, 1))
    assert 'nv_cache_num_hits_per_model{model="c",version="1"} 2' in text
    assert 'nv_cache_num_misses_per_model{model="c",version="1"} 1' in text
    assert 'nv_cache_hit_duration_per_model{model="c",version="1"} 42' in text
    assert 'nv_cache_miss_duration_per_model{model="c",version="1"} 40' in text
    assert 'model="p"' not in "".join(line for line in text.splitlines() if line.startswith("nv_cache"))
    for line in ("nv_cache_util 0.25", "nv_cache_num_entries 3", "nv_cache_num_hits 2", "nv_cache_num_misses 1",
                 "nv_cache_num_lookups 3", "nv_cache_num_evictions 1"):
        assert line in text.splitlines()
    assert "nv_cache" not in render([ModelFigures("p", "1", plain)], None)
