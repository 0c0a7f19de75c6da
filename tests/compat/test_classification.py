"""Triton's classification extension through unmodified tritonclient (``class_count``), over
HTTP (JSON and binary outputs) and gRPC: the top classes as "value:index:label" strings, labels
from the output's label_filename, for an ONNX and a Python model; Triton's errors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException


def _classify(module: Any, client: Any, model: str, inputs: dict[str, np.ndarray], output: str, count: int,
              binary: bool = True) -> np.ndarray:
    tensors = []
    for name, data in inputs.items():
        tensor = module.InferInput(name, list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        tensors.append(tensor)
    kwargs = {"binary_data": binary} if module.__name__.endswith("http") else {}
    requested = module.InferRequestedOutput(output, class_count=count, **kwargs)
    return client.infer(model, tensors, outputs=[requested]).as_numpy(output)


def _as_bytes(array: np.ndarray) -> list:
    return np.vectorize(lambda e: e if isinstance(e, bytes) else e.encode(), otypes=[object])(array).tolist()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_top_classes_with_their_labels(proto: tuple[Any, Any], binary: bool) -> None:
    module, client = proto
    x = np.array([[0.5, 3.0, 1.0, 2.0, 4.0, 0.25], [1.0, 0.0, 2.0, 0.0, 0.0, 8.0]], np.float32)
    result = _classify(module, client, "classes", {"X": x}, "Y", 3, binary)
    # Y = 2 X; class 4's label line is empty and class 5 has none: "value:index" alone. (JSON
    # gives tritonclient str elements, the binary form bytes, as with Triton.)
    assert _as_bytes(result) == [[b"8.000000:4", b"6.000000:1:one", b"4.000000:3:three"],
                               [b"16.000000:5", b"4.000000:2:two", b"2.000000:0:zero"]]
    # More classes than elements: every element, in order.
    assert _classify(module, client, "classes", {"X": x[:1, :2]}, "Y", 10, binary).shape == (1, 2)


def test_a_python_models_output_classified(proto: tuple[Any, Any]) -> None:
    module, client = proto
    a = np.array([1.0, 5.0, 2.0, 4.0], np.float32)
    result = _classify(module, client, "py_add_sub", {"INPUT0": a, "INPUT1": np.ones(4, np.float32)}, "OUTPUT0", 2)
    assert _as_bytes(result) == [b"6.000000:1", b"5.000000:3"]  # no batch dimension: max_batch_size 0


def test_classification_of_a_string_output_is_refused(proto: tuple[Any, Any]) -> None:
    module, client = proto
    text = module.InferInput("INPUT0", [1, 16], "BYTES")
    text.set_data_from_numpy(np.array([[b"1"] * 16], dtype=object))
    other = module.InferInput("INPUT1", [1, 16], "BYTES")
    other.set_data_from_numpy(np.array([[b"2"] * 16], dtype=object))
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple_string", [text, other], outputs=[module.InferRequestedOutput("OUTPUT0", class_count=2)])
    assert "class result not available for output due to unsupported type 'BYTES'" in str(info.value)


def test_server_lists_the_classification_extension(proto: tuple[Any, Any]) -> None:
    module, client = proto
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else list(metadata.extensions)
    assert "classification" in extensions

