"""A batch input file, checked line by line when it is uploaded: each line one request in
OpenAI's batch format, `{"custom_id", "method": "POST", "url", "body"}`, custom_ids unique, and the
file within its byte, line and line-length limits. A refusal names the limit and the line."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

BATCH_URLS = ("/v1/chat/completions", "/v1/completions")
"""The endpoints a batch line may call (a batch names one of them; every line must match it)."""
MAX_CUSTOM_ID_CHARS = 512
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True)
class InputLimits:
    max_bytes: int
    max_lines: int
    max_line_bytes: int


@dataclass(frozen=True)
class BatchLine:
    """One request of a batch: its position in the file (0-based) and its fields."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


class InputRefused(ValueError):
    """The file is not a batch input file; the message names the line (1-based) and the limit."""


def parse_lines(data: bytes, limits: InputLimits) -> list[BatchLine]:
    """Every line of `data`, checked; InputRefused at the first problem. A final newline is optional."""
    if len(data) > limits.max_bytes:
        raise InputRefused(f"the file has {len(data)} bytes, more than GENQ_GATEWAY_FILE_MAX_BYTES "
                           f"({limits.max_bytes})")
    raw_lines = data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    if not raw_lines:
        raise InputRefused("the file is empty: a batch input file holds one JSON request per line")
    if len(raw_lines) > limits.max_lines:
        raise InputRefused(f"the file has {len(raw_lines)} lines, more than GENQ_GATEWAY_BATCH_MAX_LINES "
                           f"({limits.max_lines})")
    lines: list[BatchLine] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_lines):
        number = index + 1
        if len(raw) > limits.max_line_bytes:
            raise InputRefused(f"line {number}: {len(raw)} bytes, more than GENQ_GATEWAY_BATCH_MAX_LINE_BYTES "
                               f"({limits.max_line_bytes})")
        line = _line(index, raw.removesuffix(b"\r"))
        if (first := seen.get(line.custom_id)) is not None:
            raise InputRefused(f"line {number}: custom_id {line.custom_id!r} is already used on line {first}; "
                               "each line's custom_id must be unique")
        seen[line.custom_id] = number
        lines.append(line)
    return lines


def _line(index: int, raw: bytes) -> BatchLine:
    number = index + 1
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as error:
        raise InputRefused(f"line {number}: not JSON: {error}"[:300]) from None
    except RecursionError:
        raise InputRefused(f"line {number}: nested too deeply") from None
    if not isinstance(value, dict):
        raise InputRefused(f"line {number}: must be a JSON object with custom_id, method, url and body")
    if unknown := sorted(set(value) - LINE_KEYS):
        raise InputRefused(f"line {number}: unknown keys {', '.join(map(repr, unknown))}; a line has "
                           "custom_id, method, url and body")
    custom_id, method, url, body = (value.get(key) for key in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise InputRefused(f"line {number}: custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if method != "POST":
        raise InputRefused(f"line {number}: method must be 'POST', got {json.dumps(method)[:40]}")
    if url not in BATCH_URLS:
        raise InputRefused(f"line {number}: url must be one of {', '.join(BATCH_URLS)}, got {json.dumps(url)[:80]}")
    if not isinstance(body, dict):
        raise InputRefused(f"line {number}: body must be a JSON object (the endpoint's request)")
    return BatchLine(index, custom_id, url, body)
