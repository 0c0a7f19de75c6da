"""Triton's Prometheus text from statistics snapshots, and the /proc CPU sampler."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rayinfer.protocol.metrics import CpuFigures, CpuSampler, GpuFigures, GpuSampler, ModelFigures, render
from rayinfer.protocol.statistics import ModelStatistics


def figures() -> ModelFigures:
    stats = ModelStatistics()
    stats.record_execution(requests=2, rows=5, input_ns=1_000, infer_ns=40_000, output_ns=2_000)
    stats.record_success(request_ns=90_500, queue_ns=3_000)
    stats.record_success(request_ns=60_000, queue_ns=1_999)
    stats.record_failure(request_ns=10)
    return ModelFigures("my_model", "1", stats.snapshot(), pending=4)


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
    text = render([ModelFigures('we"ird', "2", ModelStatistics().snapshot())], None)
    assert 'nv_inference_count{model="we\\"ird",version="2"} 0' in text.splitlines()


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
    assert 'nv_gpu_utilization{gpu_uuid="GPU-b2"} 0.0' in lines
    assert f'nv_gpu_memory_total_bytes{{gpu_uuid="GPU-a1"}} {80 * 2**30}' in lines
    assert f'nv_gpu_memory_used_bytes{{gpu_uuid="GPU-a1"}} {2**30}' in lines
    assert 'nv_gpu_power_usage{gpu_uuid="GPU-a1"} 71.5' in lines
    assert 'nv_gpu_power_limit{gpu_uuid="GPU-a1"} 300.0' in lines
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
