"""A model config's backend ``parameters`` read as typed values, with errors naming model and key.

Triton's backends take every parameter as a string (``parameters { key: "..." value {
string_value: "..." } }``) and parse it themselves; these helpers do the same for every adapter.
"""

from __future__ import annotations

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import ModelConfig

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def text(config: ModelConfig, key: str, default: str = "") -> str:
    """The parameter's string value, stripped, or ``default`` when the key is absent."""
    if key not in config.parameters:
        return default
    return config.parameters[key].string_value.strip()


def flag(config: ModelConfig, key: str, default: bool) -> bool:
    """A yes/no parameter (true/false, yes/no, 1/0, on/off, any case)."""
    value = text(config, key).lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ModelConfigError(f"model '{config.name}': parameter {key} must be true or false, got '{value}'")


def integer(config: ModelConfig, key: str, default: int, minimum: int = 0) -> int:
    """A whole-number parameter of at least ``minimum``."""
    value = text(config, key)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ModelConfigError(
            f"model '{config.name}': parameter {key} must be a whole number of at least {minimum}, got '{value}'"
        )
    return number


def number(config: ModelConfig, key: str, default: float) -> float:
    """A decimal parameter."""
    value = text(config, key)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ModelConfigError(f"model '{config.name}': parameter {key} must be a number, got '{value}'") from None


def choice(config: ModelConfig, key: str, default: str, allowed: tuple[str, ...]) -> str:
    """A parameter that takes one of ``allowed`` (compared without case; returned as listed)."""
    value = text(config, key)
    if not value:
        return default
    for option in allowed:
        if value.upper() == option.upper():
            return option
    raise ModelConfigError(
        f"model '{config.name}': parameter {key} must be one of {', '.join(allowed)}, got '{value}'"
    )
