"""Chat templates: a chat's messages rendered into one prompt, as Hugging Face tokenizers do.

A model's template is Jinja2 text (its config's ``chat_template`` parameter), rendered in
Jinja2's immutable sandbox with the variables Hugging Face's ``apply_chat_template`` gives:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (empty here) and
``raise_exception``, plus the request's ``chat_template_kwargs``. A model without one gets
:data:`DEFAULT_TEMPLATE`: each message as ``<role>: <content>`` on a line, then ``assistant:``.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rayinfer.protocol.errors import InvalidArgError

DEFAULT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")
# The largest prompt a template may render (a template that loops is stopped here).
MAX_PROMPT_CHARS = 1 << 22


class TemplateError(InvalidArgError):
    """The template refused the messages (its ``raise_exception``) or failed to render them."""

    def __init__(self, message: str):
        super().__init__(message)


def render_chat(template: str | None, model: str, messages: list[dict[str, Any]],
                arguments: dict[str, Any]) -> str:
    """The prompt of ``messages`` by ``template`` (None: the default); ``arguments``: the
    template's other variables (``add_generation_prompt`` among them)."""
    compiled = _compiled(template or DEFAULT_TEMPLATE, model)
    variables = {"bos_token": "", "eos_token": "", **arguments, "messages": messages}
    try:
        prompt = compiled.render(**variables)
    except TemplateError as exc:
        raise TemplateError(f"model '{model}': its chat template refused the messages: {exc}") from None
    except jinja2.TemplateError as exc:
        raise TemplateError(f"model '{model}': its chat template failed on the messages: {exc}") from None
    if len(prompt) > MAX_PROMPT_CHARS:
        raise TemplateError(f"model '{model}': its chat template made a prompt over {MAX_PROMPT_CHARS} characters")
    return prompt


@functools.lru_cache(maxsize=64)
def _compiled(template: str, model: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"model '{model}': its chat template is not valid Jinja2: {exc}") from None


def _raise(message: str) -> None:
    raise TemplateError(str(message))
