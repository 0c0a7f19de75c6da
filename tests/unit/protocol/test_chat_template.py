"""Chat templates: a model's Jinja2 template (its config's ``chat_template`` parameter) renders the
messages in a sandbox; what it refuses or fails on is a 400 naming the model."""

from __future__ import annotations

import pytest

from rayinfer.protocol.chat_template import DEFAULT_TEMPLATE, TemplateError, render_chat
from rayinfer.protocol.openai_requests import model_interface

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
# The shape of a Hugging Face tokenizer's chat_template (tokenizer_config.json), as Triton's
# OpenAI frontend applies it.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_the_default_template_puts_each_message_on_a_line() -> None:
    prompt = render_chat(None, "m", MESSAGES, {"add_generation_prompt": True})
    assert prompt == "system: be brief\nuser: hello\nassistant:"
    assert render_chat(DEFAULT_TEMPLATE, "m", MESSAGES, {"add_generation_prompt": False}).endswith("hello\n")


def test_a_models_template_renders_with_its_variables() -> None:
    prompt = render_chat(CHATML, "m", MESSAGES, {"add_generation_prompt": True})
    assert prompt == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    with_bos = render_chat("{{ bos_token }}{{ messages | length }}", "m", MESSAGES, {"bos_token": "<s>"})
    assert with_bos == "<s>2"


def test_raise_exception_in_a_template_is_a_bad_request_naming_the_model() -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be the user') }}{% endif %}"
    with pytest.raises(TemplateError, match="tiny_llm.*the first message must be the user"):
        render_chat(template, "tiny_llm", MESSAGES, {})


@pytest.mark.parametrize(("template", "words"), [
    ("{% for m in messages %}", "not valid Jinja2"),
    ("{{ messages.__class__.__mro__ }}", "failed"),  # the sandbox refuses private attributes
    ("{{ ''.__class__.__subclasses__() }}", "failed"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "characters"),
])
def test_templates_that_break_or_reach_outside_are_refused(template: str, words: str) -> None:
    with pytest.raises(TemplateError, match=words) as caught:
        render_chat(template, "tiny_llm", MESSAGES, {})
    assert "tiny_llm" in str(caught.value)


def test_a_config_parameter_gives_the_template() -> None:
    config = {"name": "llm", "max_batch_size": 0,
              "input": [{"name": "text_input", "data_type": "TYPE_STRING"}],
              "output": [{"name": "text_output", "data_type": "TYPE_STRING"}],
              "parameters": {"chat_template": {"string_value": CHATML}}}
    interface = model_interface(config)
    assert interface.generates_text and interface.chat_template == CHATML
    assert model_interface({**config, "parameters": {}}).chat_template is None
