"""Why a JSON body does not parse, in the words Triton's parser (rapidjson) uses.

Triton answers a body that does not parse with ``failed to parse the request JSON buffer:
<rapidjson's message> at <byte offset>``; clients and Triton's own tests look for those words.
Python's parser reports the same faults in its own words; :func:`parse_failure` translates them.
"""

from __future__ import annotations

import json
import re

# Python's message (its start) -> rapidjson's (GetParseError_En).
_REASONS = (
    ("Expecting value", "Invalid value."),
    ("Extra data", "The document root must not be followed by other values."),
    ("Expecting property name enclosed in double quotes", "Missing a name for object member."),
    ("Expecting ':' delimiter", "Missing a colon after a name of object member."),
    ("Unterminated string", "Missing a closing quotation mark in string."),
    ("Invalid control character", "Invalid encoding in string."),
    ("Invalid \\uXXXX escape", "Incorrect hex digit after \\u escape in string."),
    ("Invalid \\escape", "Invalid escape character in string."),
)
_EMPTY = "The document is empty."
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def parse_failure(body: bytes | str, exc: ValueError) -> str:
    """rapidjson's message and byte offset for ``exc``, raised by ``json.loads(body)``."""
    if isinstance(exc, UnicodeDecodeError):
        return f"Invalid encoding in string. at {exc.start}"
    if not isinstance(exc, json.JSONDecodeError):
        return str(exc)
    doc, pos = exc.doc, exc.pos
    if not doc.strip():
        return f"{_EMPTY} at {len(doc.encode())}"
    if exc.msg == "Expecting ',' delimiter":
        reason = ("Missing a comma or '}' after an object member." if _innermost(doc[:pos]) == "{"
                  else "Missing a comma or ']' after an array element.")
    else:
        reason = next((ours for theirs, ours in _REASONS if exc.msg.startswith(theirs)), exc.msg)
    return f"{reason} at {len(doc[:pos].encode())}"


def _innermost(prefix: str) -> str:
    """The bracket ('{' or '[') open at the end of ``prefix``, a JSON text cut short."""
    open_brackets: list[str] = []
    for match in _BRACKET.finditer(_STRING.sub("", prefix)):
        bracket = match.group()
        if bracket in "[{":
            open_brackets.append(bracket)
        elif open_brackets:
            open_brackets.pop()
    return open_brackets[-1] if open_brackets else ""
