"""The server renders a conversation byte-identical to transformers' ``apply_chat_template`` with
``tools`` and ``chat_template_kwargs``, on real chat templates (tests/integrations/chat_templates,
sources in SOURCES.md): the OpenAI shapes (arguments as JSON text, ``tool_call_id``) become the
shapes templates read (arguments as objects)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from asyncengine.engine import validation
from asyncengine.engine.validation import RequestLimits
from asyncengine.integrations.openai_server import chat_render
from asyncengine.integrations.openai_server.errors import APIError

TEMPLATES = Path(__file__).parent / "chat_templates"


class _Checks:
    """The engine client's message check (EngineClient.check_messages), without an engine."""

    def check_messages(self, raw):
        return validation.check_messages(raw, RequestLimits(), 4096)


CHECKS = _Checks()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
ARGS = {"city": "Paris"}


def _conversation(call_id: str):
    """(as an OpenAI client sends it, as transformers' templates expect it)."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
    openai_side = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
                   {"role": "user", "content": "And tomorrow?"}]
    hf_call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
    hf_side = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [hf_call]},
               {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
               {"role": "user", "content": "And tomorrow?"}]
    return openai_side, hf_side


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


# template, call id (Mistral's must be 9 alphanumerics), chat_template_kwargs the template reads
CASES = [("qwen2.5.jinja", "call_abc", {}),
         ("llama3.1_json.jinja", "call_abc", {"date_string": "02 Dec 2026"}),
         ("llama3.1_json.jinja", "call_abc", {"date_string": "02 Dec 2026", "tools_in_user_message": False}),
         ("mistral_v0.3.jinja", "abc123XYZ", {})]


@pytest.mark.parametrize("template,call_id,kwargs", CASES)
def test_render_is_transformers(tokenizer, template, call_id, kwargs):
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    openai_side, hf_side = _conversation(call_id)
    if template.startswith("mistral"):  # user and assistant text turns alternate, no system turn
        answer = {"role": "assistant", "content": "Sunny."}
        openai_side, hf_side = openai_side[1:4] + [answer, openai_side[4]], hf_side[1:4] + [answer, hf_side[4]]
    msgs = chat_render.checked_messages(openai_side, CHECKS)
    ours = chat_render.render(tokenizer, msgs, TOOLS, kwargs, tokenize=False)
    want = tokenizer.apply_chat_template(hf_side, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs)
    assert ours == want
    assert "get_weather" in ours and "Paris" in ours  # the tools and the earlier call are there
    ids = chat_render.render(tokenizer, msgs, TOOLS, kwargs)
    ref = tokenizer.apply_chat_template(hf_side, tools=TOOLS, add_generation_prompt=True, **kwargs)
    assert ids == list(ref["input_ids"] if hasattr(ref, "keys") else ref)


def test_kwargs_reach_the_template(tokenizer):
    tokenizer.chat_template = "{{ 'T' if enable_thinking is defined and not enable_thinking else 'F' }}"
    msgs = [{"role": "user", "content": "x"}]
    assert chat_render.render(tokenizer, msgs, None, {"enable_thinking": False}, tokenize=False) == "T"
    assert chat_render.render(tokenizer, msgs, None, {}, tokenize=False) == "F"


def test_template_errors_and_reserved_kwargs_are_400(tokenizer):
    tokenizer.chat_template = (TEMPLATES / "mistral_v0.3.jinja").read_text()
    openai_side, _ = _conversation("not-nine-chars")
    turns = openai_side[1:4] + [{"role": "assistant", "content": "Sunny."}, openai_side[4]]
    msgs = chat_render.checked_messages(turns, CHECKS)
    with pytest.raises(APIError, match="9") as e:
        chat_render.render(tokenizer, msgs, TOOLS, {})
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        chat_render.template_kwargs(chat_render.ChatConfig(), {"tokenize": False})
    assert e.value.param == "chat_template_kwargs.tokenize"
    cfg = chat_render.ChatConfig(default_chat_template_kwargs={"enable_thinking": False, "a": 1})
    assert chat_render.template_kwargs(cfg, {"a": 2}) == {"enable_thinking": False, "a": 2}
    bad = [{"role": "assistant", "content": None,
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(APIError, match="not valid JSON"):
        chat_render.checked_messages(bad, CHECKS)


def test_chat_config_checks_its_flags():
    with pytest.raises(ValueError, match="hermes"):
        chat_render.ChatConfig(tool_call_parser="nope")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        chat_render.ChatConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="qwen3"):
        chat_render.ChatConfig(reasoning_parser="nope")
