"""What a setting's flag says of it: the ``--help`` text of ``rayinfer serve``'s flags and the
defaults docs/command-line.md lists, both from :class:`ServerSettings`' fields."""

from __future__ import annotations

from rayinfer.cluster.settings import ServerSettings


def setting_default(name: str) -> str | None:
    """A setting's default as a flag's value reads (true, 8000, 127.0.0.1); None when it has none
    to show (required, a list, or unset)."""
    field = ServerSettings.model_fields[name]
    if field.default_factory is not None or field.is_required() or field.default is None:
        return None
    if isinstance(field.default, bool):
        return "true" if field.default else "false"
    return str(field.default)


def setting_help(name: str) -> str:
    """The ``--help`` text of the flag of setting ``name``: its description, then its default
    and environment variable (the same text docs/command-line.md lists)."""
    field = ServerSettings.model_fields[name]
    text = (field.description or "").rstrip()
    default = setting_default(name)
    notes = []
    if field.is_required():
        notes.append("required")
    elif default is not None and "default" not in text.lower():
        notes.append(f"default {default}")
    if field.default_factory is not None:
        notes.append("repeatable")
    notes.append(f"env RAYINFER_{name.upper()}")
    return f"{text} ({'; '.join(notes)})"
