"""TorchScript test models (scripted with torch at test time, no downloads) and their configs."""

from __future__ import annotations

from pathlib import Path

from rayinfer.cluster.example_repository import SIMPLE_CONFIG

# The example's "simple" add/sub config in TorchScript's names, FP32, with a 20 ms queue delay.
ADD_SUB_CONFIG = (
    SIMPLE_CONFIG.replace('name: "simple"\n', "").replace("onnxruntime_onnx", "pytorch_libtorch")
    .replace("INPUT", "INPUT__").replace("OUTPUT", "OUTPUT__").replace("TYPE_INT32", "TYPE_FP32")
    + "dynamic_batching { max_queue_delay_microseconds: 20000 }\ninstance_group [ { count: 1 kind: KIND_CPU } ]\n"
)

# Inputs declared in another order than forward(scale, values): bound by name.
NAMED_CONFIG = """backend: "pytorch"
max_batch_size: 4
input [
  { name: "values" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "scale" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [
  { name: "scaled" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "total" data_type: TYPE_INT64 dims: [ 1 ] }
]
parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }
parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }
"""

# A sequence model: an accumulator whose sum is its implicit state; the control inputs and the
# state are bound by position like the inputs (forward(INPUT__0, START__1, READY__2, ACC_IN__3)).
SEQUENCE_CONFIG = """backend: "pytorch"
max_batch_size: 2
sequence_batching {
  direct { }
  max_sequence_idle_microseconds: 120000000
  control_input [
    { name: "START__1" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY__2" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
  state [ { input_name: "ACC_IN__3" output_name: "ACC_OUT__1" data_type: TYPE_INT32 dims: [ 1 ] } ]
}
input [ { name: "INPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# The test repository's TorchScript models: name -> (config, module factory name).
MODELS = {"ts_add_sub": (ADD_SUB_CONFIG, "add_sub"), "ts_named": (NAMED_CONFIG, "named"),
          "ts_sequence": (SEQUENCE_CONFIG, "accumulate")}


def modules() -> dict:
    """name -> a scripted module (torch imported here, only when models are written)."""
    import torch
    from torch import Tensor

    class AddSub(torch.nn.Module):
        def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
            return a + b, a - b

    class Named(torch.nn.Module):
        def forward(self, scale: Tensor, values: Tensor) -> list[Tensor]:
            return [values * scale, values.sum(dim=1, keepdim=True)]

    class Accumulate(torch.nn.Module):
        def forward(self, value: Tensor, start: Tensor, ready: Tensor, acc: Tensor) -> tuple[Tensor, Tensor]:
            total = torch.where(start > 0, torch.zeros_like(acc), acc) + value * ready
            return total, total

    class Identity(torch.nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.clone()

    class Fails(torch.nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.reshape(3, -1)

    return {
        "add_sub": torch.jit.script(AddSub()),
        "named": torch.jit.script(Named()),
        "accumulate": torch.jit.script(Accumulate()),
        "identity": torch.jit.script(Identity()),
        "fails": torch.jit.script(Fails()),
        "traced": torch.jit.trace(AddSub(), (torch.zeros(1, 16), torch.zeros(1, 16))),
    }


def write_torchscript_model(root: Path, name: str, config: str | None, module, version: int = 1) -> Path:
    """``<root>/<name>/config.pbtxt`` and ``<version>/model.pt``."""
    import torch

    version_dir = root / name / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / name / "config.pbtxt").write_text(config)
    torch.jit.save(module, str(version_dir / "model.pt"))
    return root / name


def write_torchscript_models(root: Path) -> None:
    built = modules()
    for name, (config, module) in MODELS.items():
        write_torchscript_model(root, name, config, built[module])
