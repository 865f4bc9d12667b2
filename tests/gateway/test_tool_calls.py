"""Tool calling in the gateway, without a server: the Hermes-format parser (whole and
streamed at every split point), the grammar builder (checked with llguidance's own matcher on
the test tokenizer), and the rendering of tools and tool turns (the fallback, and a template
that reads `tools` against transformers' `apply_chat_template(tools=...)`)."""

from __future__ import annotations

import json
import re
import shutil

import llguidance
import pytest
from tokenizers import Tokenizer

from gateway.protocol import ChatMessage
from gateway.structured.grammar_child import check
from gateway.structured.protocol import FunctionDefinition, NamedToolChoice
from gateway.structured.tool_grammar import call_schema, tool_grammar
from gateway.structured.tool_parsing import ToolCallStream, parse_tool_calls
from gateway.structured.tool_rendering import fallback_messages, template_input
from gateway.tokenizer import ChatTokenizer, reads_tools

WEATHER = FunctionDefinition(
    name="get_weather",
    description="The weather in a city.",
    parameters={
        "type": "object",
        "properties": {"city": {"$ref": "#/$defs/City"}, "days": {"type": "integer"}},
        "required": ["city"],
        "additionalProperties": False,
        "$defs": {"City": {"type": "string", "maxLength": 12}},
    },
)
NOOP = FunctionDefinition(name="noop")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# --- parsing ---------------------------------------------------------------------------

ANSWERS = {
    "text only": ("  Hello there.\n", "Hello there.", []),
    "one call": (CALL, "", [("get_weather", '{"city":"Paris"}')]),
    "text then calls": (
        f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}",
        "Let me check.",
        [("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Rome"}')],
    ),
    "text around a call": (
        f"Before\n{CALL}\nAfter",
        "Before\n\nAfter",
        [("get_weather", '{"city":"Paris"}')],
    ),
    "a block that is not a call stays content": (
        "x <tool_call>\nnot json\n</tool_call> y",
        "x <tool_call>\nnot json\n</tool_call> y",
        [],
    ),
    "an unfinished block stays content": (
        'ok <tool_call>\n{"name": "noop", "argu',
        'ok <tool_call>\n{"name": "noop", "argu',
        [],
    ),
    "a lone angle bracket": ("a < b and <tool", "a < b and <tool", []),
    "unicode arguments": (
        '<tool_call>\n{"name": "noop", "arguments": {"q": "héllo 世界"}}\n</tool_call>',
        "",
        [("noop", '{"q":"héllo 世界"}')],
    ),
}


@pytest.mark.parametrize("text, content, calls", ANSWERS.values(), ids=ANSWERS.keys())
def test_a_whole_answer_splits_into_content_and_calls(text, content, calls):
    out = parse_tool_calls(text)
    assert out.content == content
    assert [(c.name, c.arguments) for c in out.calls] == calls
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in out.calls)
    assert len({c.id for c in out.calls}) == len(out.calls)


@pytest.mark.parametrize("text, content, calls", ANSWERS.values(), ids=ANSWERS.keys())
def test_streaming_gives_the_same_answer_at_every_split_point(text, content, calls):
    for cut in range(len(text) + 1):
        stream = ToolCallStream()
        out = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        assert (out.content, [(c.name, c.arguments) for c in out.calls]) == (content, calls), cut
        assert stream.calls_made == len(calls)


@pytest.mark.parametrize("text, content, calls", ANSWERS.values(), ids=ANSWERS.keys())
def test_streaming_one_character_at_a_time(text, content, calls):
    stream = ToolCallStream()
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(p.content for p in pieces) == content
    assert [(c.name, c.arguments) for p in pieces for c in p.calls] == calls


def test_streaming_holds_back_only_what_may_start_a_call():
    stream = ToolCallStream()
    assert stream.feed("Hi <tool").content == "Hi"  # " <tool" may still open a block
    assert stream.feed("kit> done").content == " <toolkit> done"
    piece = stream.feed(" " + CALL[:20])
    assert piece.content == "" and piece.calls == []
    piece = stream.feed(CALL[20:])
    assert [c.name for c in piece.calls] == ["get_weather"]


# --- grammar ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def matcher_for(model_dir):
    """A fresh llguidance matcher of a grammar, on the test tokenizer (EOS: <|im_end|>)."""
    hf = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = hf.token_to_id("<|im_end|>")
    tokenizer = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), eos_token=eos)

    class Matcher:
        def __init__(self, grammar: str) -> None:
            self.m = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("lark", grammar))
            assert not self.m.is_error(), self.m.get_error()

        def feed(self, text: str) -> bool:
            return self.m.consume_tokens(hf.encode(text, add_special_tokens=False).ids)

        def allows(self, text: str) -> bool:
            """Whether the grammar takes all of ``text`` next (the matcher stays put)."""
            ids = hf.encode(text, add_special_tokens=False).ids
            return self.m.validate_tokens(ids) == len(ids)

        def may_end(self) -> bool:
            mask = self.m.compute_bitmask()
            return bool(mask[eos // 8] >> (eos % 8) & 1)

    return Matcher


CHOICES = ["auto", "required", NamedToolChoice(type="function", function={"name": "noop"})]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_every_tool_grammar_is_valid(choice, parallel):
    grammar = tool_grammar([WEATHER, NOOP], choice, parallel=parallel)
    assert check("lark", grammar) == ""


def test_tool_choice_none_has_no_grammar():
    assert tool_grammar([WEATHER], "none", parallel=True) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_allows_a_text_answer_and_constrains_every_call(matcher_for, parallel):
    grammar = tool_grammar([WEATHER, NOOP], "auto", parallel=parallel)
    text = matcher_for(grammar)
    assert text.feed("The weather is fine.") and text.may_end()
    call = matcher_for(grammar)
    assert call.feed("Checking. <tool_call>\n")
    assert not call.may_end() and not call.allows("not json")
    assert call.feed('{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert call.may_end()
    assert not matcher_for(grammar).allows('<tool_call>\n{"name": "other", ')
    again = call.allows('\nAgain <tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert again == parallel  # without parallel calls, nothing after the one call holds another


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_one_or_more_calls_and_nothing_else(matcher_for, parallel):
    grammar = tool_grammar([WEATHER, NOOP], "required", parallel=parallel)
    m = matcher_for(grammar)
    assert not m.may_end() and not m.allows("Hello")
    assert m.feed('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>')
    assert m.may_end()
    assert m.allows('\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>') == parallel
    assert not m.allows(" trailing text")


def test_a_named_function_is_called_once_with_its_own_arguments(matcher_for):
    named = NamedToolChoice(type="function", function={"name": "get_weather"})
    m = matcher_for(tool_grammar([WEATHER, NOOP], named, parallel=True))
    assert not m.allows('<tool_call>\n{"name": "noop"')
    assert not m.allows('<tool_call>\n{"name": "get_weather", "arguments": {"town"')
    assert m.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert m.feed("\n</tool_call>") and m.may_end()
    assert not m.allows("\n")


def test_call_schema_reroots_references_and_leaves_data_alone():
    tricky = FunctionDefinition(
        name="t",
        parameters={
            "type": "object",
            "properties": {"x": {"$ref": "#/$defs/X"}, "k": {"const": {"$ref": "#/keep"}}},
            "$defs": {"X": {"type": "integer"}},
        },
    )
    one = call_schema([tricky])
    assert one["properties"]["arguments"]["properties"]["x"] == {
        "$ref": "#/properties/arguments/$defs/X"
    }
    assert one["properties"]["arguments"]["properties"]["k"] == {"const": {"$ref": "#/keep"}}
    both = call_schema([NOOP, tricky])
    ref = both["anyOf"][1]["properties"]["arguments"]["properties"]["x"]["$ref"]
    assert ref == "#/anyOf/1/properties/arguments/$defs/X"
    assert check("json_schema", json.dumps(both)) == ""


# --- rendering ---------------------------------------------------------------------------

CONVERSATION = [
    ChatMessage(role="system", content="Be brief."),
    ChatMessage(role="user", content="Weather in Paris and Rome?"),
    ChatMessage(
        role="assistant",
        content=None,
        tool_calls=[
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
        ],
    ),
    ChatMessage(role="tool", content="18 C, sunny", tool_call_id="call_1"),
    ChatMessage(role="tool", content="21 C, cloudy", tool_call_id="call_2"),
]
TOOLS = [WEATHER.for_template()]


def test_the_fallback_renders_tools_calls_and_results_as_hermes_text():
    messages = [m.for_template(i) for i, m in enumerate(CONVERSATION)]
    out = fallback_messages(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(TOOLS[0], ensure_ascii=False)}\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in system
    assert out[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    assert out[3]["content"] == (
        "<tool_response>\n18 C, sunny\n</tool_response>\n"
        "<tool_response>\n21 C, cloudy\n</tool_response>"
    )
    assert all(set(m) == {"role", "content"} for m in out)


def test_the_fallback_without_a_system_message_or_tools():
    messages = [m.for_template(i) for i, m in enumerate(CONVERSATION[1:])]
    assert fallback_messages(messages, TOOLS)[0] == {
        "role": "system",
        "content": fallback_messages([], TOOLS)[0]["content"],
    }
    plain = fallback_messages(messages, None)  # tool_choice "none": history only
    assert [m["role"] for m in plain] == ["user", "assistant", "user"]


def test_the_default_chatml_template_does_not_read_tools(model_dir):
    tokenizer = ChatTokenizer.from_dir(model_dir)
    assert not tokenizer.renders_tools
    messages = [m.for_template(i) for i, m in enumerate(CONVERSATION)]
    messages, tools = template_input(messages, TOOLS, native=tokenizer.renders_tools)
    text = tokenizer.render_chat(messages, tools=tools)
    assert "<|im_start|>system\nBe brief.\n\n# Tools" in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


# A template in the Qwen2.5 style: it reads `tools` and renders calls and results itself.
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}

{% endif %}Tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% continue %}{% endif %}
{%- if message.role == 'tool' %}<|im_start|>tool ({{ message.tool_call_id }})
{{ message.content }}<|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}CALL {{ call.function.name }} \
{{ call.function.arguments | tojson }}
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_reads_tools_renders_as_transformers_does(model_dir, tmp_path):
    from transformers import AutoTokenizer  # the reference (imports torch; fine in tests)

    path = tmp_path / "tools-model"
    shutil.copytree(model_dir, path)
    (path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    ours = ChatTokenizer.from_dir(path)
    assert ours.renders_tools and reads_tools(TOOLS_TEMPLATE)
    messages = [m.for_template(i) for i, m in enumerate(CONVERSATION)]
    messages, tools = template_input(messages, TOOLS, native=ours.renders_tools)
    assert tools == TOOLS
    reference = AutoTokenizer.from_pretrained(str(path))
    expected = reference.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    rendered = ours.render_chat(messages, tools=tools)
    assert rendered == expected
    assert 'CALL get_weather {"city": "Rome"}' in rendered
    assert "<|im_start|>tool (call_2)\n21 C, cloudy" in rendered
