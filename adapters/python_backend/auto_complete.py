"""``pb_utils.ModelConfig``: the config a model's ``auto_complete_config`` completes, in Triton's
JSON form."""

from __future__ import annotations

from typing import Any

from rayinfer.adapters.python_backend.errors import TritonModelException


class ModelConfig:
    """The config ``auto_complete_config`` receives: Triton's JSON form, completed in place."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        current = int(self._config.get("max_batch_size", 0))
        if current and current != max_batch_size:
            raise TritonModelException(
                f"configuration specified max_batch_size {current}, but auto-complete-config function "
                f"for model '{self._config.get('name')}' tries to set max_batch_size to {max_batch_size}"
            )
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        self._add("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        self._add("output", output)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        self._config.setdefault("model_transaction_policy", {}).update(transaction_policy_dict)

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        name = tensor.get("name")
        if not name or "data_type" not in tensor or "dims" not in tensor:
            raise TritonModelException(f"model {kind} must have 'name', 'data_type' and 'dims': {tensor}")
        tensors = self._config.setdefault(kind, [])
        existing = next((t for t in tensors if t.get("name") == name), None)
        if existing is None:
            tensors.append(dict(tensor))
            return
        for key in ("data_type", "dims"):
            if key in existing and existing[key] and [str(v) for v in _listed(existing[key])] != \
                    [str(v) for v in _listed(tensor[key])]:
                raise TritonModelException(
                    f"model {kind} '{name}': the configuration's {key} {existing[key]} differs from "
                    f"auto-complete-config's {tensor[key]}"
                )
        for key, value in tensor.items():
            existing.setdefault(key, value)


def _listed(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]
