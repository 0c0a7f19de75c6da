"""ONNX Runtime backend (``platform: onnxruntime_onnx`` / ``backend: onnxruntime``)."""
