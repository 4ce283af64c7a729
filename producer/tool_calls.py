"""Tool calls in a model's output: one incremental parser per model family, the family read
from the chat template, a generic tool prompt for templates that know no tools, and the
grammar that forces a call.

Imports only the standard library: the worker parses while it streams, the gateway may parse
a finished text, and both must read it the same way.

Formats (docs/tools.md shows each):

- ``hermes``: Hermes 2 Pro, Qwen 2.5, Qwen 3. Content, then one or more
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks.
- ``llama3_json``: Llama 3.1-3.3. ``{"name": ..., "parameters": {...}}``, after
  ``<|python_tag|>`` or at the very start of the output, several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v0.3), or
  ``[TOOL_CALLS]name[ARGS]{...}`` repeated (the newer tokenizers). A bare array at the very
  start of the output is read as calls too.
- ``json``: the whole output is one call object or a list of them.

A call object's keys may come in any order (Hermes 2 Pro writes "arguments" before "name");
"arguments" and "parameters" are the same key; "id" and "type" are skipped; any other key makes
the region not a call.

How ``ToolCallStream`` reads (one state machine per stream, fed text as it is decoded):

- Content is emitted at once, except a suffix that could still become a call's start marker.
- From the marker on, text is withheld. When the call's name is known and its arguments object
  has begun (``{``), a ``CallStart`` (index, id, name) is emitted, then the arguments' raw JSON
  text in pieces as it arrives (``ArgumentsDelta``), exactly as the model wrote it, up to the
  closing ``}`` of the arguments. The wrapper (the call object's own braces and keys,
  ``</tool_call>``, ``;``, the array's brackets) is never emitted.
- A small strict JSON scanner (string and escape aware) decides where each value ends and that
  it is valid JSON, so a finished call's arguments always parse as a JSON object.
- If the region turns out not to be a call before its ``CallStart`` (bad JSON, no name, an
  unknown key, arguments that are not an object), the withheld text is returned as content and
  no call is reported; reading goes on after the marker, so a later call is still found. After
  the ``CallStart`` nothing can be taken back: a character that breaks the JSON ends the call
  there and the rest of the output is content; an output that ends inside the arguments (the
  length limit) leaves the call with the arguments streamed so far, as OpenAI does for
  ``finish_reason: "length"``. A call is constrained from its start (forced_call_grammar for
  tool_choice required or named, auto_call_grammar once an "auto" output commits to a call),
  so there only the length case occurs.
- Whitespace after a call is dropped when the output ends or another call follows.

``parse()`` runs the same stream over a whole text and assembles the deltas, so a streamed and a
non-streamed answer are equal by construction, for every way the text is split into pieces.

Where genq differs from vLLM's tool parsers (hermes_tool_parser.py, llama_tool_parser.py,
mistral_tool_parser.py) and TabbyAPI's:

- vLLM re-parses the whole text at each step with a partial-JSON parser and streams the diff of
  ``json.dumps`` of the partial arguments, so streamed arguments are re-serialized (key spacing,
  escapes and number spelling may change) and the non-streamed path is separate code (regexes)
  that can disagree with it. genq scans once, passes the model's own text through, and has one
  path for both.
- TabbyAPI parses most formats at the end of generation (streaming clients get each call whole),
  and streams incrementally only for its pseudo-XML format, with a cross-check that logs when the
  two paths disagree. genq needs no cross-check: there is one path.
- vLLM and TabbyAPI draw call ids at random (uuid4); genq derives them from a seed (the request
  id) and the call's index, so a redelivered attempt reports the same ids. Mistral templates
  require 9 alphanumeric characters for ids in history; the mistral format uses that shape, the
  others ``call_`` + 24 hex digits.
- vLLM's llama parser finds calls anywhere with a regex over braces; genq takes a bare call only
  at the start of the output (or after ``<|python_tag|>``), so JSON inside prose stays content.
- The forced-call grammar is in the family's own format (vLLM forces a bare JSON list for
  ``required`` whatever the model was trained on). Markers that are special tokens (Mistral's
  ``[TOOL_CALLS]``) cannot be written as text in a grammar, so the forced mistral grammar is the
  bare array that the parser also accepts at the start of the output.
- ``strict: true`` (OpenAI: the arguments must validate against the schema) changes nothing in
  the grammar: a constrained call's arguments always validate, strict or not; the schema is used
  as given (with ``additionalProperties: false`` only if the tool says so).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3_json", "mistral", "json"]
TOOL_FORMATS: tuple[ToolFormat, ...] = ("hermes", "llama3_json", "mistral", "json")

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
LLAMA_PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
SPECIAL_MARKERS = (LLAMA_PYTHON_TAG, MISTRAL_TOOL_CALLS)
"""Markers that are special tokens in their families' tokenizers."""
MISTRAL_ARGS = "[ARGS]"

MAX_NAME_CHARS = 64
"""OpenAI's limit on a function name (^[a-zA-Z0-9_-]{1,64}$)."""
NAME_PATTERN = rf"[A-Za-z0-9_-]{{1,{MAX_NAME_CHARS}}}"
_NAME_RE = re.compile(NAME_PATTERN)
_MISTRAL_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-.")
_WS = frozenset(" \t\n\r")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ToolCall:
    """One call: arguments is the JSON text of the arguments object exactly as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ContentDelta:
    """Text for the message's content (OpenAI ``delta.content``)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """A call begins: ``delta.tool_calls[i]`` with its index, id, type "function" and name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """A piece of call ``index``'s arguments (``delta.tool_calls[i].function.arguments``)."""

    index: int
    text: str


ToolCallDelta = ContentDelta | CallStart | ArgumentsDelta


def call_id(seed: str, index: int, fmt: ToolFormat = "hermes") -> str:
    """The id of call ``index`` of the output seeded by ``seed`` (the request id and choice):
    the same for a redelivered attempt. Mistral's templates require 9 alphanumerics."""
    digest = hashlib.sha256(f"{seed}\x00{index}".encode()).digest()
    if fmt == "mistral":
        alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        number = int.from_bytes(digest, "big")
        chars = []
        for _ in range(9):
            number, digit = divmod(number, len(alphabet))
            chars.append(alphabet[digit])
        return "".join(chars)
    return "call_" + digest.hex()[:24]


def call_seed(identifier: str, index: int) -> str:
    """The seed of the call ids of choice ``index`` of request ``identifier``: the worker's result
    and the gateway's streamed deltas derive the same ids from it."""
    return f"{identifier}:{index}"


def assemble(deltas: Iterable[ToolCallDelta]) -> tuple[str, list[ToolCall]]:
    """The content and calls that a sequence of deltas adds up to (what a client assembles)."""
    content: list[str] = []
    starts: dict[int, CallStart] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if isinstance(delta, ContentDelta):
            content.append(delta.text)
        elif isinstance(delta, CallStart):
            starts[delta.index] = delta
            arguments[delta.index] = []
        else:
            arguments[delta.index].append(delta.text)
    calls = [ToolCall(s.id, s.name, "".join(arguments[i])) for i, s in sorted(starts.items())]
    return "".join(content), calls


def parse(text: str, fmt: ToolFormat, seed: str = "") -> tuple[str, list[ToolCall]]:
    """The content and the tool calls of a whole output: the stream parser run over it."""
    stream = ToolCallStream(fmt, seed)
    return assemble([*stream.feed(text), *stream.finish()])


# --------------------------------------------------------------------------- JSON scanner

_MORE, _DONE, _DONE_BEFORE, _ERROR = range(4)
(
    _J_VALUE,
    _J_AFTER,
    _J_KEY_OR_END,
    _J_KEY,
    _J_COLON,
    _J_ITEM_OR_END,
    _J_STRING,
    _J_ESCAPE,
    _J_UNICODE,
    _J_LITERAL,
    _J_MINUS,
    _J_ZERO,
    _J_INT,
    _J_DOT,
    _J_FRAC,
    _J_EXP,
    _J_EXP_SIGN,
    _J_EXP_DIGITS,
) = range(18)
_NUMBER_END_OK = frozenset({_J_ZERO, _J_INT, _J_FRAC, _J_EXP_DIGITS})
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")


class _JsonScanner:
    """Strict incremental JSON syntax (RFC 8259) for one value, a character at a time: says
    whether the value goes on, ended with this character, ended just before it, or is broken."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.state = _J_VALUE
        self.in_key = False
        self.pending = ""  # the rest of a literal, or the hex digits left of a \\u escape

    def feed(self, c: str) -> int:
        state = self.state
        if state == _J_STRING:
            if c == '"':
                return self._string_done()
            if c == "\\":
                self.state = _J_ESCAPE
            elif c < " ":
                return _ERROR
            return _MORE
        if state == _J_ESCAPE:
            if c == "u":
                self.state, self.pending = _J_UNICODE, "xxxx"
            elif c in '"\\/bfnrt':
                self.state = _J_STRING
            else:
                return _ERROR
            return _MORE
        if state == _J_UNICODE:
            if c not in _HEX:
                return _ERROR
            self.pending = self.pending[1:]
            if not self.pending:
                self.state = _J_STRING
            return _MORE
        if state == _J_LITERAL:
            if c != self.pending[0]:
                return _ERROR
            self.pending = self.pending[1:]
            return _MORE if self.pending else self._value_done()
        if state >= _J_MINUS:
            return self._number(c)
        if c in _WS:
            return _MORE
        if state == _J_VALUE:
            return self._value_start(c)
        if state == _J_AFTER:
            top = self.stack[-1]
            if c == ",":
                self.state = _J_KEY if top == "{" else _J_VALUE
                return _MORE
            if c == ("}" if top == "{" else "]"):
                self.stack.pop()
                return self._value_done()
            return _ERROR
        if state == _J_KEY_OR_END and c == "}":
            self.stack.pop()
            return self._value_done()
        if state in (_J_KEY_OR_END, _J_KEY):
            if c != '"':
                return _ERROR
            self.state, self.in_key = _J_STRING, True
            return _MORE
        if state == _J_COLON:
            if c != ":":
                return _ERROR
            self.state = _J_VALUE
            return _MORE
        # _J_ITEM_OR_END
        if c == "]":
            self.stack.pop()
            return self._value_done()
        return self._value_start(c)

    def _value_start(self, c: str) -> int:
        if c == "{":
            self.stack.append("{")
            self.state = _J_KEY_OR_END
        elif c == "[":
            self.stack.append("[")
            self.state = _J_ITEM_OR_END
        elif c == '"':
            self.state, self.in_key = _J_STRING, False
        elif c == "-":
            self.state = _J_MINUS
        elif c == "0":
            self.state = _J_ZERO
        elif c in _DIGITS:
            self.state = _J_INT
        elif c in "tfn":
            self.state, self.pending = _J_LITERAL, {"t": "rue", "f": "alse", "n": "ull"}[c]
        else:
            return _ERROR
        return _MORE

    def _string_done(self) -> int:
        if self.in_key:
            self.state, self.in_key = _J_COLON, False
            return _MORE
        return self._value_done()

    def _value_done(self) -> int:
        if not self.stack:
            return _DONE
        self.state = _J_AFTER
        return _MORE

    def _number(self, c: str) -> int:
        state = self.state
        digit = c in _DIGITS
        if state == _J_MINUS:
            nxt = _J_ZERO if c == "0" else _J_INT if digit else None
        elif state in (_J_ZERO, _J_INT):
            nxt = _J_INT if digit and state == _J_INT else _J_DOT if c == "." else _J_EXP if c in "eE" else None
        elif state == _J_DOT:
            nxt = _J_FRAC if digit else None
        elif state == _J_FRAC:
            nxt = _J_FRAC if digit else _J_EXP if c in "eE" else None
        elif state == _J_EXP:
            nxt = _J_EXP_SIGN if c in "+-" else _J_EXP_DIGITS if digit else None
        elif state == _J_EXP_SIGN:
            nxt = _J_EXP_DIGITS if digit else None
        else:
            nxt = _J_EXP_DIGITS if digit else None
        if nxt is not None:
            self.state = nxt
            return _MORE
        if state not in _NUMBER_END_OK:
            return _ERROR
        # The number ended just before c; c belongs to what follows it.
        if not self.stack:
            return _DONE_BEFORE
        self.state = _J_AFTER
        return self.feed(c)


# --------------------------------------------------------------------------- one call object

_ARGUMENT_KEYS = ("arguments", "parameters")
_SKIPPED_KEYS = ("id", "type")
(_C_KEY_OR_END, _C_KEY, _C_COLON, _C_VALUE, _C_KEY_TEXT, _C_NAME, _C_ARGS, _C_SKIP, _C_AFTER) = range(9)


class _CallObject:
    """The call object after its ``{``: collects the name, passes the arguments' raw text to
    ``args_text`` as it arrives, and says when the object closes or turns out not to be a call."""

    def __init__(self) -> None:
        self.state = _C_KEY_OR_END
        self.key_raw: list[str] = []
        self.key = ""
        self.seen: set[str] = set()
        self.name: str | None = None
        self.name_raw: list[str] = []
        self.args_started = False
        self.args_text: list[str] = []  # arguments text not yet handed out
        self.value: _JsonScanner | None = None

    def feed(self, c: str) -> int:
        state = self.state
        if state in (_C_KEY_TEXT, _C_NAME, _C_ARGS, _C_SKIP):
            assert self.value is not None
            result = self.value.feed(c)
            if result == _ERROR or result == _DONE_BEFORE and state != _C_SKIP:
                return _ERROR
            if state == _C_KEY_TEXT:
                self.key_raw.append(c)
            elif state == _C_NAME:
                self.name_raw.append(c)
            elif state == _C_ARGS:
                self.args_text.append(c)
            if result == _MORE:
                return _MORE
            return self._value_done(state, c if result == _DONE_BEFORE else None)
        if c in _WS:
            return _MORE
        if state in (_C_KEY_OR_END, _C_KEY):
            if state == _C_KEY_OR_END and c == "}":
                return _DONE
            if c != '"':
                return _ERROR
            self.state, self.value, self.key_raw = _C_KEY_TEXT, _JsonScanner(), [c]
            self.value.feed(c)
            return _MORE
        if state == _C_COLON:
            if c != ":":
                return _ERROR
            self.state = _C_VALUE
            return _MORE
        if state == _C_VALUE:
            self.value = _JsonScanner()
            if self.key == "name":
                if c != '"':
                    return _ERROR
                self.state, self.name_raw = _C_NAME, [c]
            elif self.key in _ARGUMENT_KEYS:
                if c != "{":
                    return _ERROR
                self.state, self.args_started = _C_ARGS, True
                self.args_text.append(c)
            else:
                self.state = _C_SKIP
            return _ERROR if self.value.feed(c) == _ERROR else _MORE
        # _C_AFTER
        if c == ",":
            self.state = _C_KEY
            return _MORE
        return _DONE if c == "}" else _ERROR

    def _value_done(self, state: int, refeed: str | None) -> int:
        if state == _C_KEY_TEXT:
            key = json.loads("".join(self.key_raw))
            key = "arguments" if key in _ARGUMENT_KEYS else key
            if key in self.seen or key not in ("name", "arguments", *_SKIPPED_KEYS):
                return _ERROR
            self.seen.add(key)
            self.key, self.state = key, _C_COLON
            return _MORE
        if state == _C_NAME:
            self.name = json.loads("".join(self.name_raw))
            if not self.name:
                return _ERROR
        self.state = _C_AFTER
        return _MORE if refeed is None else self.feed(refeed)


# --------------------------------------------------------------------------- the stream

(
    _S_START,  # only whitespace so far: a bare call region may begin here
    _S_CONTENT,  # content, looking for a marker
    _S_AFTER_MARKER,  # after a marker: whitespace, then what opens the region
    _S_OBJECT,  # inside a call object
    _S_MISTRAL_NAME,  # [TOOL_CALLS]name
    _S_MISTRAL_ARGS_TAG,  # the [ARGS] after the name
    _S_MISTRAL_ARGS_WS,  # whitespace before the arguments object
    _S_MISTRAL_ARGS,  # the arguments object of the name form
    _S_AFTER_CALL,  # after a call object: what closes or continues the region
    _S_END_TAG,  # </tool_call>
    _S_GAP,  # after a region: whitespace is held until something follows
) = range(11)

_MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    "hermes": (HERMES_START,),
    "llama3_json": (LLAMA_PYTHON_TAG,),
    "mistral": (MISTRAL_TOOL_CALLS,),
    "json": (),
}
_BARE_START: dict[ToolFormat, str] = {"hermes": "", "llama3_json": "{", "mistral": "[", "json": "{["}


class ToolCallStream:
    """Incremental tool-call parser for one output in one format; see the module docstring.

    ``feed(text)`` returns the deltas that text settles; ``finish()`` those left at the end.
    Call ids come from ``call_id(seed, index, format)``.
    """

    def __init__(self, fmt: ToolFormat, seed: str = "") -> None:
        if fmt not in TOOL_FORMATS:
            raise ValueError(f"tool call format must be one of {', '.join(TOOL_FORMATS)}, got {fmt!r}")
        self.format: ToolFormat = fmt
        self.seed = seed
        self.markers = _MARKERS[fmt]
        self.state = _S_START
        self.out: list[ToolCallDelta] = []
        self.held = ""  # content held back (a possible marker prefix), or a region's withheld text
        self.gap = ""  # whitespace after a region: dropped before another call or at the end
        self.region_marker = ""  # the marker that opened the current region ("" when bare)
        self.in_array = False
        self.calls = 0
        self.confirmed = False  # the current call's CallStart was emitted
        self.region_confirmed = False  # some call of the current region was emitted
        self.call: _CallObject | None = None
        self.scanner: _JsonScanner | None = None
        self.name = ""
        self.tag = ""  # progress through a fixed tag ([ARGS], </tool_call>) or a separator
        self.finished = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self.finished:
            raise RuntimeError("ToolCallStream.feed after finish()")
        self._run(text)
        return self._take()

    def finish(self) -> list[ToolCallDelta]:
        """The deltas left at the end: held content, and a region that never became a call."""
        if not self.finished:
            self.finished = True
            while self.state in _OPENING and not self.confirmed:
                self._fail()
            if self.state in (_S_START, _S_CONTENT) and self.held:
                self._content(self.held)
            self.held = self.gap = ""
        return self._take()

    # ------------------------------------------------------------------ machinery

    def _take(self) -> list[ToolCallDelta]:
        merged: list[ToolCallDelta] = []
        for delta in self.out:
            last = merged[-1] if merged else None
            if isinstance(delta, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + delta.text)
            elif isinstance(delta, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == delta.index:
                merged[-1] = ArgumentsDelta(delta.index, last.text + delta.text)
            else:
                merged.append(delta)
        self.out = []
        return merged

    def _content(self, text: str) -> None:
        if text:
            self.out.append(ContentDelta(self.gap + text))
            self.gap = ""

    def _run(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self.state == _S_CONTENT:
                i = self._scan_content(text, i)
                continue
            self._step(text[i])
            i += 1
            if self.call is not None:
                self._drain_call()

    def _scan_content(self, text: str, i: int) -> int:
        """Content up to the first marker, emitted at once less a suffix that may begin one."""
        buffer = self.held + text[i:]
        self.held = ""
        hits = [(at, m) for m in self.markers if (at := buffer.find(m)) >= 0]
        if hits:
            at, marker = min(hits)
            if at == 0:
                self.gap = ""
            self._content(buffer[:at])
            self._open_region(marker)
            return len(text) - (len(buffer) - at - len(marker))
        keep = max((n for m in self.markers for n in range(1, len(m)) if buffer.endswith(m[:n])), default=0)
        self._content(buffer[: len(buffer) - keep])
        self.held = buffer[len(buffer) - keep :]
        return len(text)

    def _open_region(self, marker: str) -> None:
        self.state = _S_AFTER_MARKER
        self.region_marker = marker
        self.held = marker
        self.confirmed = self.region_confirmed = False

    def _step(self, c: str) -> None:
        state = self.state
        if state == _S_START:
            if c in _WS:
                self.held += c
            elif c in _BARE_START[self.format]:
                leading = self.held
                self._open_region("")
                self.held = leading
                self._region_opener(c)
            else:
                self.state = _S_CONTENT
                self._run(c)
            return
        if state == _S_GAP:
            if c in _WS:
                self.gap += c
            else:
                self.state = _S_CONTENT
                self._run(c)
            return
        self.held += c
        if state == _S_AFTER_MARKER:
            if c not in _WS:
                self._region_opener(c)
        elif state == _S_OBJECT:
            assert self.call is not None
            result = self.call.feed(c)
            if result == _ERROR:
                self._fail()
            elif result == _DONE:
                self._object_done()
        elif state == _S_MISTRAL_NAME:
            if c == "[":
                self.tag, self.state = c, _S_MISTRAL_ARGS_TAG
            elif c in _MISTRAL_NAME_CHARS and len(self.name) < MAX_NAME_CHARS:
                self.name += c
            else:
                self._fail()
        elif state == _S_MISTRAL_ARGS_TAG:
            self.tag += c
            if not MISTRAL_ARGS.startswith(self.tag):
                self._fail()
            elif self.tag == MISTRAL_ARGS:
                self.state = _S_MISTRAL_ARGS_WS
        elif state == _S_MISTRAL_ARGS_WS:
            if c == "{":
                self._start_mistral_args()
            elif c not in _WS:
                self._fail()
        elif state == _S_MISTRAL_ARGS:
            self._mistral_args(c)
        elif state == _S_AFTER_CALL:
            self._after_call(c)
        else:  # _S_END_TAG
            self.tag += c
            if not HERMES_END.startswith(self.tag):
                self._end_region(refeed=self.tag)
            elif self.tag == HERMES_END:
                self._end_region()

    def _region_opener(self, c: str) -> None:
        """The first non-space character of a region: a call object, an array of them, or a
        Mistral function name."""
        if not self.region_marker:
            self.held += c
        if c == "{" and self.format != "mistral":
            self._start_object(in_array=False)
        elif c == "[" and self.format in ("mistral", "json"):
            self.in_array, self.tag = True, "["
            self.state = _S_AFTER_CALL
        elif self.format == "mistral" and self.region_marker and c in _MISTRAL_NAME_CHARS:
            self.name, self.state = c, _S_MISTRAL_NAME
        else:
            self._fail()

    def _start_object(self, in_array: bool) -> None:
        self.in_array = in_array
        self.call = _CallObject()
        self.confirmed = False
        self.state = _S_OBJECT

    def _start_mistral_args(self) -> None:
        self.call = _CallObject()
        self.call.name, self.call.args_started = self.name, True
        self.call.args_text.append("{")
        self.scanner = _JsonScanner()
        self.scanner.feed("{")
        self.confirmed = False
        self.state = _S_MISTRAL_ARGS

    def _drain_call(self) -> None:
        """Emit the current call's start once its name is known and its arguments have begun,
        then whatever arguments text has arrived."""
        call = self.call
        assert call is not None
        if not self.confirmed:
            if call.name is None or not call.args_started:
                return
            self.out.append(CallStart(self.calls, call_id(self.seed, self.calls, self.format), call.name))
            self.confirmed = self.region_confirmed = True
            self.calls += 1
        if call.args_text:
            self.out.append(ArgumentsDelta(self.calls - 1, "".join(call.args_text)))
            call.args_text = []
            self.held = ""

    def _object_done(self) -> None:
        call = self.call
        assert call is not None
        if call.name is None:
            self._fail()
            return
        if not call.args_started:
            call.args_started, call.args_text = True, ["{}"]
        self._drain_call()
        self.call = None
        self.held = self.tag = ""
        self.state = _S_AFTER_CALL

    def _after_call(self, c: str) -> None:
        """After a call object: the region's separator, its end, or the text after it."""
        if c in _WS:
            return
        if self.in_array:
            expect_item, self.tag = self.tag == "[", ""
            if c == "{" and expect_item:
                self._start_object(in_array=True)
            elif c == "," and not expect_item:
                self.tag = "["
            elif c == "]" and not expect_item:
                self._end_region()
            else:
                self._fail()
        elif self.format == "hermes" and HERMES_END.startswith(c):
            self.tag, self.state = c, _S_END_TAG
        elif self.format == "llama3_json" and c == ";" and not self.tag:
            self.tag = ";"
        elif self.format == "llama3_json" and c == "{" and self.tag == ";":
            self._start_object(in_array=False)
        else:
            self._end_region(refeed=self.tag + c)

    def _mistral_args(self, c: str) -> None:
        assert self.scanner is not None and self.call is not None
        result = self.scanner.feed(c)
        if result == _ERROR:
            self._fail()
            return
        self.call.args_text.append(c)
        if result == _DONE:
            self._drain_call()
            self._end_region()

    def _end_region(self, refeed: str = "") -> None:
        """The region is over; refeed is text after it to read as content."""
        self.state = _S_GAP
        self.held = self.tag = ""
        self.call = self.scanner = None
        self._run(refeed)

    def _fail(self) -> None:
        """The region is not (or no longer) a call. Before any of its calls was emitted its text
        is content: the marker at once, the rest read again. After, the withheld text since the
        last emitted piece is read again as content."""
        withheld, marker = self.held, self.region_marker
        self.call = self.scanner = None
        self.held = self.tag = ""
        self.state = _S_CONTENT
        if self.region_confirmed:
            self.confirmed = False
            self._run(withheld)
            return
        self._content(marker)
        self._run(withheld[len(marker) :])


_OPENING = frozenset(
    {_S_AFTER_MARKER, _S_OBJECT, _S_MISTRAL_NAME, _S_MISTRAL_ARGS_TAG, _S_MISTRAL_ARGS_WS, _S_MISTRAL_ARGS}
    | {_S_AFTER_CALL}
)
"""States in which the current call may still be unconfirmed (finish() fails it)."""


# --------------------------------------------------------------------------- chat templates

_TEMPLATE_BLOCK = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_TOOLS_VARIABLE = re.compile(r"\b(?:tools|custom_tools)\b")


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template reads the ``tools`` variable (outside its string literals), as
    Hugging Face's tool-use templates do."""
    if not chat_template:
        return False
    return any(
        _TOOLS_VARIABLE.search(_STRING_LITERAL.sub("", block.group()))
        for block in _TEMPLATE_BLOCK.finditer(chat_template)
    )


def detect_format(chat_template: str | None) -> ToolFormat:
    """The tool-call format a model writes, from the markers its chat template renders history
    with. A template without tool support gets the generic tool prompt, which asks for the
    hermes format; a tool template without a known marker gets the plain-JSON fallback."""
    if not template_supports_tools(chat_template):
        return "hermes"
    assert chat_template is not None
    if MISTRAL_TOOL_CALLS in chat_template:
        return "mistral"
    if HERMES_START in chat_template:
        return "hermes"
    if LLAMA_PYTHON_TAG in chat_template or "<|start_header_id|>ipython" in chat_template:
        return "llama3_json"
    return "json"


GENERIC_TOOL_PROMPT = """\
You can call functions to help you answer. Each function is described by one line of JSON \
below, between <tools> and </tools>; its "parameters" are a JSON Schema for its arguments.
<tools>
{tools}
</tools>

To call a function, write a JSON object with the function's "name" and its "arguments" (an \
object that matches the function's parameters) between <tool_call> and </tool_call>, like this:
<tool_call>
{{"name": "function_name", "arguments": {{"parameter": "value"}}}}
</tool_call>
To call several functions, write one such block for each. When no function is needed, answer \
in plain text. Function results come back to you between <tool_response> and </tool_response>."""
"""The system text genq adds for a chat template that does not read ``tools``."""


def generic_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """GENERIC_TOOL_PROMPT listing the tools (OpenAI's ``tools`` entries), one JSON line each."""
    lines = [json.dumps(dict(tool), ensure_ascii=False) for tool in tools]
    return GENERIC_TOOL_PROMPT.format(tools="\n".join(lines))


def with_generic_tool_prompt(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the generic tool prompt joined to
    the system message (or a new one first), assistant tool calls written as <tool_call> blocks,
    and tool results as user messages of <tool_response> blocks (consecutive results merged, so
    templates that insist on alternating roles still render)."""
    out: list[dict[str, Any]] = []
    after_result = False
    for message in messages:
        if message.get("role") == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if after_result:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_result = True
            continue
        after_result = False
        converted = {k: v for k, v in message.items() if k != "tool_calls"}
        if message.get("tool_calls"):
            blocks = [
                f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
                for call in _call_objects(message["tool_calls"])
            ]
            text = _text(message.get("content"))
            converted["content"] = "\n".join([text, *blocks] if text else blocks)
        out.append(converted)
    prompt = generic_tool_prompt(tools)
    if out and out[0].get("role") == "system":
        text = _text(out[0].get("content"))
        out[0]["content"] = f"{text}\n\n{prompt}" if text else prompt
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the tool templates expect them, as vLLM prepares them: each assistant tool
    call's ``function.arguments`` as an object rather than OpenAI's JSON string (the templates
    write it with ``tojson``, which would quote a string a second time; arguments that are not a
    JSON object stay as they are), and content "" where an assistant message with tool calls has
    none (Qwen 3's template reads the content of every assistant message)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        converted = dict(message)
        if message.get("tool_calls"):
            converted["tool_calls"] = [_decoded_call(call) for call in message["tool_calls"]]
            if converted.get("content") is None:
                converted["content"] = ""
        out.append(converted)
    return out


def _decoded_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return dict(call)
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return dict(call)
    if not isinstance(arguments, dict):
        return dict(call)
    return {**call, "function": {**function, "arguments": arguments}}


def _call_objects(tool_calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """{"name", "arguments"} of each OpenAI tool call, arguments as an object where they parse."""
    objects = []
    for call in tool_calls:
        function = _decoded_call(call).get("function", {})
        objects.append({"name": function.get("name"), "arguments": function.get("arguments", {})})
    return objects


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


# --------------------------------------------------------------------------- forced calls

ToolChoice = Literal["required"] | Mapping[str, Any]
"""A choice that forces a call: "required" (any of the tools) or OpenAI's named choice
``{"type": "function", "function": {"name": ...}}``."""

_CALL_SEPARATOR: dict[ToolFormat, str] = {"hermes": "\n", "llama3_json": "; ", "mistral": ", ", "json": ", "}
_COMPACT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""How the forced JSON is spaced: as json.dumps writes it, which is how the tool templates
render calls in history (tojson), so the model sees its own style."""


@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI ``tools`` entry of type function."""

    name: str
    parameters: dict[str, Any]
    description: str = ""
    strict: bool = False


def function_tools(tools: Sequence[Mapping[str, Any]]) -> list[FunctionTool]:
    """OpenAI ``tools`` entries as FunctionTool records; ValueError naming the bad field.
    A function without ``parameters`` takes none (an empty object), as OpenAI defines it."""
    records = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
            raise ValueError(f'{where}: must be {{"type": "function", "function": {{...}}}}')
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(
                f"{where}.function.name: must be 1 to {MAX_NAME_CHARS} letters, digits, '_' or '-', got {name!r}"
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ValueError(f"{where}.function.parameters: must be a JSON Schema object")
        records.append(
            FunctionTool(name, dict(parameters), str(function.get("description") or ""), bool(function.get("strict")))
        )
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    return records


def forced_call_grammar(
    tools: Sequence[Mapping[str, Any]], choice: ToolChoice, fmt: ToolFormat, parallel_tool_calls: bool = True
) -> tuple[Literal["lark"], str]:
    """A Lark grammar (llguidance) whose every sentence is a call, or with parallel_tool_calls one
    or more calls, in the family's format: "required" allows any of the tools, a named choice
    that tool only. Each call is {"name": <one of the names>, "arguments": <that tool's
    parameters schema>} in that key order ("parameters" for llama3_json), so the arguments
    always parse and validate. ToolCallStream(fmt) reads every sentence as calls."""
    records = function_tools(tools)
    if choice == "required":
        chosen = records
    elif isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, Mapping) else None
        chosen = [r for r in records if r.name == name]
        if not chosen:
            raise ValueError(f"tool_choice: names no function of tools ({', '.join(r.name for r in records)})")
    else:
        raise ValueError(f'tool_choice: only "required" or a named function forces a call, got {choice!r}')
    if not chosen:
        raise ValueError("tools: a forced call needs at least one function")
    return "lark", _calls_grammar("start: calls", chosen, fmt, parallel_tool_calls)


def auto_call_grammar(
    tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, parallel_tool_calls: bool = True,
    marker_ids: Mapping[str, int] | None = None,
) -> tuple[Literal["lark"], str]:
    """tool_choice "auto": a Lark grammar (llguidance) under which the output is free text until
    it commits to a call, and from there a call as forced_call_grammar writes it, so a call the
    model chooses to make always parses and validates:

    - hermes: at the first ``<tool_call>`` anywhere (a lazy lexeme: the free text ends at the
      first one); with parallel_tool_calls text and further calls may follow, else the output
      ends with the call, as a forced one does;
    - llama3_json: an output that opens with ``{`` (the bare call the parser reads at the
      start), or with the ``<|python_tag|>`` token;
    - mistral: an output that opens with ``[`` or with the ``[TOOL_CALLS]`` token;
    - json: an output that opens with ``{`` or ``[`` (with parallel_tool_calls, one call object
      or a list of them, as the parser reads them).

    ``marker_ids``: the token ids of the markers that are special tokens in the model's
    tokenizer (``<|python_tag|>``, ``[TOOL_CALLS]``); a grammar's free text cannot hold a special
    token, so these are allowed by id before a call, where the model writes them."""
    records = function_tools(tools)
    if not records:
        raise ValueError("tools: tool_choice auto needs at least one function")
    if fmt == "hermes":
        # `call` opens with the free text before it, up to the first <tool_call>.
        call = f'call_text "\\n" body "\\n{_lark(HERMES_END)}"'
        start = f"start: ({call})* text" if parallel_tool_calls else f"start: text | {call}"
        head = [start, f'call_text[lazy]: TEXT "{_lark(HERMES_START)}"']
        return "lark", _calls_grammar("\n".join(head), records, fmt, parallel_tool_calls, free_text=True)
    openers = "".join(f"\\{c}" for c in {"llama3_json": "{", "mistral": "[", "json": "{["}[fmt])
    marker = {"llama3_json": LLAMA_PYTHON_TAG, "mistral": MISTRAL_TOOL_CALLS}.get(fmt)
    marker_id = (marker_ids or {}).get(marker) if marker is not None else None
    lead = f"<[{marker_id}]>? " if marker_id is not None else ""
    calls = "(body | calls)" if fmt == "json" and parallel_tool_calls else "calls"  # one object, or a list
    head = [f"start: /\\s*/ {lead}{calls} | /\\s*([^\\s{openers}](.|\\n)*)?/"]
    return "lark", _calls_grammar("\n".join(head), records, fmt, parallel_tool_calls)


def _calls_grammar(head: str, chosen: Sequence[FunctionTool], fmt: ToolFormat, parallel_tool_calls: bool,
                   free_text: bool = False) -> str:
    """`head` (the start rules) with the rules of the calls to `chosen` in `fmt`: `calls` (one,
    or with parallel_tool_calls one or more, in the family's wrapping), `body` (one call object)
    and its tools' schemas; with `free_text`, `text` (any text) and its terminal `TEXT`."""
    if fmt not in TOOL_FORMATS:
        raise ValueError(f"tool call format must be one of {', '.join(TOOL_FORMATS)}, got {fmt!r}")
    key = "parameters" if fmt == "llama3_json" else "arguments"
    rules = [f"tool{i}: %json {json.dumps(_call_schema(r, key), ensure_ascii=False)}" for i, r in enumerate(chosen)]
    if fmt == "hermes":
        call = f'"{_lark(HERMES_START)}\\n" body "\\n{_lark(HERMES_END)}"'
    else:
        call = "body"
    more = f' ("{_lark(_CALL_SEPARATOR[fmt])}" {call})*' if parallel_tool_calls else ""
    calls = f"{call}{more}"
    if fmt == "mistral" or (fmt == "json" and parallel_tool_calls):
        calls = f'"[" {calls} "]"'
    body = " | ".join(f"tool{i}" for i in range(len(chosen)))
    free = ["text: TEXT", "TEXT: /(.|\\n)*/"] if free_text else []
    return "\n".join(["%llguidance {}", head, f"calls: {calls}", f"body: {body}", *free, *rules]) + "\n"


def _call_schema(tool: FunctionTool, key: str) -> dict[str, Any]:
    """{"name": const, key: parameters} as one JSON Schema document. The parameters' own
    definitions ($defs, definitions) move to the document's root, where their "#/..." references
    point (pydantic writes them so)."""
    parameters = dict(tool.parameters)
    definitions: dict[str, Any] = {k: parameters.pop(k) for k in ("$defs", "definitions") if k in parameters}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
        **definitions,
        "x-guidance": _COMPACT,
    }


def _lark(text: str) -> str:
    """text inside a Lark double-quoted string."""
    return json.dumps(text)[1:-1]
