"""Triton's OpenVINO backend (``backend: "openvino"``): OpenVINO IR (and ONNX) models on the CPU."""
