"""TensorRT backend (tensorrt_plan)."""
