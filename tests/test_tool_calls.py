"""producer.tool_calls: the tool-call parsers (whole outputs, and streamed in every split, which
must assemble to the same result), the call ids, and the grammars that force a call (checked
with llguidance over a real tokenizer)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import pytest

from engine.tokenizer import Tokenizer
from producer.tool_calls import (
    TOOL_FORMATS,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ToolCallStream,
    ToolFormat,
    assemble,
    auto_call_grammar,
    call_id,
    forced_call_grammar,
    function_tools,
    parse,
)

WEATHER = '{"city": "Paris", "days": [1, 2.5e-1, -3], "note": "a \\"quoted\\" } and ]", "ok": true, "x": null}'

# (format, output, expected content, expected [(name, arguments)])
CASES: list[tuple[ToolFormat, str, str, list[tuple[str, str]]]] = [
    (
        "hermes",
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",  # Qwen: several calls; Hermes 2 Pro: arguments before name
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"arguments": {"k": [{"n": 1}]}, "name": "b"}\n</tool_call>\n',
        "",
        [("a", "{}"), ("b", '{"k": [{"n": 1}]}')],
    ),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b>.", "No tools needed: 2 < 3 and <b>bold</b>.", []),
    (
        "hermes",  # text after a call is content; the end tag is never content
        '<tool_call>{"name": "a", "arguments": {"q": "x"}}</tool_call> Done.',
        " Done.",
        [("a", '{"q": "x"}')],
    ),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"n": 1}}; {"name": "b", "arguments": {"m": 0.5}}',
        "",
        [("a", '{"n": 1}'), ("b", '{"m": 0.5}')],
    ),
    ("llama3_json", 'Here: {"name": "a", "parameters": {}}', 'Here: {"name": "a", "parameters": {}}', []),
    (
        "mistral",
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "b", "arguments": {{}}, '
        '"id": "aB3dE5gH7"}]',
        "",
        [("get_weather", WEATHER), ("b", "{}")],
    ),
    (
        "mistral",  # the newer name[ARGS] form, after some content
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]b[ARGS]{}',
        "Sure.",
        [("get_weather", '{"city": "Rome"}'), ("b", "{}")],
    ),
    ("mistral", '[{"name": "a", "arguments": {"z": 1}}]', "", [("a", '{"z": 1}')]),  # marker dropped by decoding
    ("json", f'{{"name": "get_weather", "arguments": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    ("json", ' [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"c": 1}}]\n', "", [("a", "{}"), ("b", '{"c": 1}')]),  # noqa: E501
    ("json", "Paris is sunny.", "Paris is sunny.", []),
]

# Regions that are not calls: returned whole as content, no call reported.
MALFORMED: list[tuple[ToolFormat, str]] = [
    ("hermes", 'A <tool_call>\n{"name": "a", "arguments": [1]}\n</tool_call> B'),  # arguments not an object
    ("hermes", 'A <tool_call>\n{"nam": "a", "arguments": {}}\n</tool_call>'),  # unknown key
    ("hermes", 'A <tool_call>\n{"arguments": {"x": 1}}\n</tool_call>'),  # no name
    ("hermes", 'A <tool_call>\n{"name": "a" "arguments": {}}\n</tool_call>'),  # bad JSON
    ("hermes", 'A <tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'),  # empty name
    ("hermes", "A <tool_call>\nnot json\n</tool_call>"),
    ("hermes", 'A <tool_call>\n{"name": "a"'),  # the output ends before the arguments begin
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", "  {not json"),
    ("mistral", "[TOOL_CALLS] []"),
    ("mistral", "[1, 2, 3]"),
    ("mistral", "[TOOL_CALLS]bad name[ARGS]{}"),
    ("json", '{"name": "a", "extra": 1, "arguments": {}}'),  # unknown key before the arguments
    ("json", '["a", "b"]'),
]


def _stream(fmt: ToolFormat, pieces: list[str], seed: str = "seed") -> list[Any]:
    stream = ToolCallStream(fmt, seed)
    deltas = [d for piece in pieces for d in stream.feed(piece)]
    return deltas + stream.finish()


def _splits(text: str, rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        pieces.append(text[i : i + n])
        i += n
    return pieces


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parse_whole_output(fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse(text, fmt, seed="req-1")
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [call_id("req-1", i, fmt) for i in range(len(calls))]
    for call in got_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("fmt", "text"), [(c[0], c[1]) for c in CASES] + MALFORMED)
def test_streamed_in_every_split_assembles_to_parse(fmt: ToolFormat, text: str) -> None:
    whole = parse(text, fmt, seed="seed")
    assert assemble(_stream(fmt, list(text))) == whole  # one character at a time
    rng = random.Random(text)
    for _ in range(40):
        assert assemble(_stream(fmt, _splits(text, rng))) == whole


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_region_is_content(fmt: ToolFormat, text: str) -> None:
    assert parse(text, fmt) == (text, [])


def test_stream_emits_name_then_arguments_as_they_arrive() -> None:
    stream = ToolCallStream("hermes", "r")
    assert stream.feed("Checking <tool") == [ContentDelta("Checking ")]  # "<tool" may begin the marker
    assert stream.feed('_call>\n{"name": "get_weather", "argu') == []  # withheld until the arguments begin
    start = CallStart(0, call_id("r", 0), "get_weather")
    assert stream.feed('ments": {"city": "Pa') == [start, ArgumentsDelta(0, '{"city": "Pa')]
    assert stream.feed('ris"}}\n</tool_call>') == [ArgumentsDelta(0, 'ris"}')]
    assert stream.feed("\n<tool_call>\n") == []
    assert stream.feed('{"name": "now", "arguments": {}}') == [CallStart(1, call_id("r", 1), "now"), ArgumentsDelta(1, "{}")]  # noqa: E501
    assert stream.finish() == []


def test_held_marker_prefix_that_is_not_a_marker_is_content() -> None:
    stream = ToolCallStream("hermes")
    assert stream.feed("a <tool") == [ContentDelta("a ")]
    assert stream.feed("box> b <") == [ContentDelta("<toolbox> b ")]
    assert stream.finish() == [ContentDelta("<")]


def test_call_cut_off_keeps_the_arguments_streamed_so_far() -> None:
    """The length limit inside a call: the call stays, with the arguments that arrived (as OpenAI
    reports a call cut by finish_reason "length"); the wrapper is never content."""
    content, calls = parse('Hi <tool_call>\n{"name": "a", "arguments": {"city": "Pa', "hermes")
    assert content == "Hi "
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"city": "Pa')]


def test_broken_json_after_the_call_started_ends_it_and_the_rest_is_content() -> None:
    content, calls = parse('<tool_call>\n{"name": "a", "arguments": {"n": 1 x}}\n</tool_call>', "hermes")
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"n": 1 ')]
    assert content == "x}}\n</tool_call>"


def test_a_failed_region_does_not_hide_a_later_call() -> None:
    content, calls = parse('<tool_call>oops</tool_call>\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>', "hermes")  # noqa: E501
    assert content == "<tool_call>oops</tool_call>\n"
    assert [(c.name, c.arguments) for c in calls] == [("a", "{}")]


def test_call_ids_are_deterministic_per_seed() -> None:
    assert call_id("req-1", 0) == call_id("req-1", 0)
    assert call_id("req-1", 0) != call_id("req-1", 1) != call_id("req-2", 1)
    hermes = call_id("req-1", 0, "hermes")
    assert hermes.startswith("call_") and len(hermes) == 29 and int(hermes[5:], 16) >= 0
    mistral = call_id("req-1", 0, "mistral")
    assert len(mistral) == 9 and mistral.isalnum()  # what Mistral's templates require in history


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="tool call format must be one of"):
        ToolCallStream("xml")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- forced calls

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
    {
        "type": "function",
        "function": {  # pydantic's shape: $defs at the root of the parameters, "#/$defs/..." references
            "name": "book",
            "parameters": {
                "$defs": {"Guest": {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}},
                "type": "object",
                "properties": {"guest": {"$ref": "#/$defs/Guest"}},
                "required": ["guest"],
            },
        },
    },
]


@pytest.fixture(scope="module")
def lltokenizer(tiny_model_factory: Callable[..., Path]) -> llguidance.LLTokenizer:
    tokenizer = Tokenizer.from_dir(tiny_model_factory("llama"))
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eos_token_id)  # noqa: E501


def _accepts(lltokenizer: llguidance.LLTokenizer, grammar: tuple[str, str], text: str) -> bool:
    matcher = llguidance.LLMatcher(lltokenizer, llguidance.grammar_from(*grammar))
    assert not matcher.is_error(), matcher.get_error()
    tokens = lltokenizer.tokenize_str(text)
    if matcher.validate_tokens(tokens) != len(tokens):
        return False
    assert matcher.consume_tokens(tokens)
    return bool(matcher.is_accepting())


def _wrap(fmt: ToolFormat, objects: list[str]) -> str:
    """Calls written as the family writes them (and as the forced grammar spaces them)."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if fmt == "llama3_json":
        return "; ".join(objects)
    if fmt == "mistral" or len(objects) > 1:
        return "[" + ", ".join(objects) + "]"
    return objects[0]


def _call(fmt: ToolFormat, name: str, arguments: str) -> str:
    key = "parameters" if fmt == "llama3_json" else "arguments"
    return f'{{"name": "{name}", "{key}": {arguments}}}'


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_grammar_validates(fmt: ToolFormat, parallel: bool, choice: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    syntax, grammar = forced_call_grammar(TOOLS, "required" if choice == "required" else named, fmt, parallel)
    assert syntax == "lark"
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(syntax, grammar)) == ""


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_forced_grammar_accepts_calls_and_refuses_wrong_ones(lltokenizer, fmt: ToolFormat) -> None:
    required = forced_call_grammar(TOOLS, "required", fmt, parallel_tool_calls=False)
    good = _wrap(fmt, [_call(fmt, "get_weather", '{"city": "Paris", "unit": "c"}')])
    assert _accepts(lltokenizer, required, good)
    content, calls = parse(good, fmt)  # the parser reads every forced sentence as calls
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "unit": "c"}')]  # noqa: E501
    assert _accepts(lltokenizer, required, _wrap(fmt, [_call(fmt, "now", "{}")]))
    assert _accepts(lltokenizer, required, _wrap(fmt, [_call(fmt, "book", '{"guest": {"age": 30}}')]))
    refused = [
        _call(fmt, "get_wether", '{"city": "Paris"}'),  # no such tool
        _call(fmt, "get_weather", '{"city": 5}'),  # wrong type
        _call(fmt, "get_weather", '{"unit": "c"}'),  # required property missing
        _call(fmt, "get_weather", '{"city": "Paris", "unit": "k"}'),  # not in the enum
        _call(fmt, "get_weather", '{"city": "Paris", "extra": 1}'),  # strict: no other properties
        _call(fmt, "book", '{"guest": {"age": "old"}}'),  # through the $ref
        '{"arguments": {"city": "Paris"}, "name": "get_weather"}',  # key order is name, then arguments
    ]
    for wrong in refused:
        assert not _accepts(lltokenizer, required, _wrap(fmt, [wrong])), wrong
    two = _wrap(fmt, [_call(fmt, "now", "{}"), _call(fmt, "get_weather", '{"city": "Rome"}')])
    assert not _accepts(lltokenizer, required, two)  # parallel_tool_calls false: one call
    assert _accepts(lltokenizer, forced_call_grammar(TOOLS, "required", fmt, parallel_tool_calls=True), two)
    assert [c.name for c in parse(two, fmt)[1]] == ["now", "get_weather"]


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_named_choice_forces_that_tool_only(lltokenizer, fmt: ToolFormat) -> None:
    grammar = forced_call_grammar(TOOLS, {"type": "function", "function": {"name": "now"}}, fmt, False)
    assert _accepts(lltokenizer, grammar, _wrap(fmt, [_call(fmt, "now", "{}")]))
    assert not _accepts(lltokenizer, grammar, _wrap(fmt, [_call(fmt, "get_weather", '{"city": "Paris"}')]))


WRONG_CALLS = [
    ("get_wether", '{"city": "Paris"}'),  # no such tool
    ("get_weather", '{"city": 5}'),  # wrong type
    ("get_weather", '{"unit": "c"}'),  # required property missing
    ("get_weather", '{"city": "Paris", "extra": 1}'),  # strict: no other properties
]


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_auto_grammar_leaves_text_free_and_constrains_a_call_once_it_starts(
        lltokenizer, fmt: ToolFormat, parallel: bool) -> None:
    grammar = auto_call_grammar(TOOLS, fmt, parallel)
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(*grammar)) == ""
    for text in ("It is sunny in Paris.", " Sure: no tool is needed.\n\nBye", ""):
        assert _accepts(lltokenizer, grammar, text), text
    call = _wrap(fmt, [_call(fmt, "get_weather", '{"city": "Paris"}')])
    assert _accepts(lltokenizer, grammar, call)
    assert [c.name for c in parse(call, fmt)[1]] == ["get_weather"]
    for name, arguments in WRONG_CALLS:
        assert not _accepts(lltokenizer, grammar, _wrap(fmt, [_call(fmt, name, arguments)])), (name, arguments)
    two = _wrap(fmt, [_call(fmt, "now", "{}"), _call(fmt, "get_weather", '{"city": "Rome"}')])
    assert _accepts(lltokenizer, grammar, two) == parallel
    if fmt == "hermes":  # a call may follow text, and with parallel calls text may follow a call
        assert _accepts(lltokenizer, grammar, f"Let me look.\n{call}")
        assert not _accepts(lltokenizer, grammar, "Let me look.\n" + _wrap(fmt, [_call(fmt, *WRONG_CALLS[1])]))
        assert _accepts(lltokenizer, grammar, f"{call}\nDone.") == parallel
    else:  # JSON inside prose stays prose, as the parser reads it
        assert _accepts(lltokenizer, grammar, f"Here: {call}")


def test_auto_grammar_allows_a_special_marker_token_before_the_call(
        lltokenizer, tiny_model_factory: Callable[..., Path]) -> None:
    marker = Tokenizer.from_dir(tiny_model_factory("llama")).token_to_id("<|pad|>")  # a special token, by id
    assert marker is not None
    for fmt, key in (("mistral", "[TOOL_CALLS]"), ("llama3_json", "<|python_tag|>")):
        grammar = llguidance.grammar_from(*auto_call_grammar(TOOLS, fmt, True, {key: marker}))
        for tokens in ([], [marker]):
            matcher = llguidance.LLMatcher(lltokenizer, grammar)
            call = tokens + lltokenizer.tokenize_str(_wrap(fmt, [_call(fmt, "now", "{}")]))
            assert matcher.consume_tokens(call) and matcher.is_accepting(), (fmt, tokens)
        matcher = llguidance.LLMatcher(lltokenizer, grammar)
        assert not matcher.consume_tokens([marker, *lltokenizer.tokenize_str("plain text")])


def test_bad_tools_and_choices_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        function_tools([{"type": "function", "function": {"name": "has space"}}])
    with pytest.raises(ValueError, match=r"tools\[1\]: must be"):
        function_tools([TOOLS[0], {"type": "retrieval"}])
    with pytest.raises(ValueError, match="unique"):
        function_tools([TOOLS[1], TOOLS[1]])
    with pytest.raises(ValueError, match="names no function"):
        forced_call_grammar(TOOLS, {"type": "function", "function": {"name": "missing"}}, "hermes")
    with pytest.raises(ValueError, match="only \"required\" or a named function"):
        forced_call_grammar(TOOLS, "auto", "hermes")  # type: ignore[arg-type]
