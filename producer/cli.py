"""`genq submit | stream | cancel | result | adapters | keys`: the producer side of the command line.

worker/cli.py defines the options and explains the exit codes (EXIT_* below) in each
command's --help; it imports this module only when one of these commands runs, so they
never load torch or the worker.
"""

from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import sys
import time
from pathlib import Path
from typing import Any

import redis
from kombu.exceptions import OperationalError
from kombu.utils.url import maybe_sanitize_url

from producer.client import GenerationError, GenerationHandle, GenqClient, StreamRestarted, TextAssembler
from producer.protocol import MAX_IMAGE_BYTES, GenerationResult, ProtocolError, StreamEvent, grammar_syntax
from producer.tenants.keys import KeyLimits, KeyProblem, KeyStore

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_TIMEOUT = 4
EXIT_UNREACHABLE = 5
EXIT_INTERRUPTED = 130

EXIT_BY_FINISH_REASON = {"stop": EXIT_DONE, "length": EXIT_DONE, "deadline": EXIT_TIMEOUT,
                         "cancelled": EXIT_CANCELLED, "error": EXIT_FAILED}
TIMEOUT_GRACE_S = 10.0
"""`submit --timeout S` makes S the request's deadline, and waits S plus this much for its end
(a worker that stops at the deadline still has to report it)."""
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "seed")
REQUEST_OPTIONS = ("max_new_tokens", "min_new_tokens", "priority", "n", "max_skips", "stop", "ignore_eos",
                   "banned_strings", "token_healing", "identifier", "adapter")
"""Options named after their request field (dest), copied into the request when given."""


class UsageError(Exception):
    """A command-line input that cannot become a request (unreadable file, malformed list)."""


# --- Commands ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run `genq {args.command}` with a client, turning the failures every command shares into exit codes."""
    command = {"submit": _submit, "stream": _stream, "cancel": _cancel, "result": _result,
               "adapters": _adapters, "keys": _keys}[args.command]
    url = args.redis_url
    try:
        with GenqClient(redis_url=url, queue=getattr(args, "queue", None)) as client:
            url = client.settings.redis_url
            return command(client, args)
    except (ProtocolError, UsageError, KeyProblem) as error:
        _say(f"error: {error}")
        return EXIT_USAGE
    except GenerationError as error:
        _end_line()
        _say(f"error: request {error.identifier} failed: {error.message}")
        return EXIT_FAILED
    except (redis.ConnectionError, redis.TimeoutError, OperationalError) as error:
        _say(f"error: cannot reach Redis at {maybe_sanitize_url(url or '(GENQ_REDIS_URL)')}: {error}")
        return EXIT_UNREACHABLE
    except TimeoutError as error:
        _end_line()
        _say(f"error: {error}")
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        _end_line()
        return EXIT_INTERRUPTED


def _submit(client: GenqClient, args: argparse.Namespace) -> int:
    request = request_from_args(args)
    wait = None
    if args.timeout is not None:
        request["deadline"] = time.time() + args.timeout
        wait = args.timeout + TIMEOUT_GRACE_S
    if args.stream and not args.json and request.get("n", 1) > 1:
        raise UsageError("--stream shows one text: with --n above 1 add --json (every chunk carries its sample's "
                         "index) or leave --stream out (each sample is printed at the end)")
    handle = client.submit(request)
    if args.detach:
        handle.close()
        print(handle.id)
        return EXIT_DONE
    _say(handle.id)
    try:
        if args.stream:
            return _follow(handle, wait, args.json)
        return _print_result(handle.result(timeout=wait), args.json)
    except TimeoutError:
        handle.cancel()  # nobody is left to read it
        raise
    except KeyboardInterrupt:
        handle.cancel()
        _end_line()
        _say(f"interrupted: cancelled {handle.id}")
        return EXIT_INTERRUPTED


def _stream(client: GenqClient, args: argparse.Namespace) -> int:
    return _follow(client.handle(args.id), args.timeout, args.json)


def _cancel(client: GenqClient, args: argparse.Namespace) -> int:
    client.cancel(args.id)
    _say(f"cancel requested for {args.id}")
    return EXIT_DONE


def _adapters(client: GenqClient, args: argparse.Namespace) -> int:
    if args.action == "load":
        client.load_adapter(args.name, args.path)
        _say(f"load of adapter {args.name} from {args.path} sent to the workers of queue {client.settings.queue}")
    else:
        client.unload_adapter(args.name)
        _say(f"unload of adapter {args.name} sent to the workers of queue {client.settings.queue}")
    return EXIT_DONE


def _keys(client: GenqClient, args: argparse.Namespace) -> int:
    """API keys: the key itself goes to stdout once (create, rotate), everything else to stderr
    or, for list, one JSON object a line."""
    store = KeyStore(client.redis, client.settings.key_prefix)
    if args.action == "create":
        limits = KeyLimits(rpm=args.rpm, tpm=args.tpm, concurrent=args.concurrent, max_priority=args.max_priority)
        record, secret = store.create(args.tenant, args.name or "", limits)
        _say(f"created API key {record.id} of tenant {record.tenant}; the key is shown this once:")
        print(secret, flush=True)
    elif args.action == "list":
        for record in store.list():
            print(json.dumps(record.to_public()), flush=True)
    elif args.action == "rotate":
        record, secret = store.rotate(args.id)
        _say(f"rotated API key {record.id} of tenant {record.tenant}: the old key is refused from now on; "
             f"the new one is shown this once:")
        print(secret, flush=True)
    else:
        record = store.revoke(args.id)
        _say(f"revoked API key {record.id} of tenant {record.tenant}: every gateway refuses it from now on")
    return EXIT_DONE


def _result(client: GenqClient, args: argparse.Namespace) -> int:
    handle = client.handle(args.id)
    try:
        outcome = handle.result(timeout=args.wait)
    except TimeoutError:
        state = handle.state
        hint = " (an unknown id, or still queued)" if state == "PENDING" else ""
        _say(f"error: {args.id} has not finished within {args.wait:g} s: state {state}{hint}")
        return EXIT_TIMEOUT
    return _print_result(outcome, args.json)


# --- Building the request ----------------------------------------------------------


def request_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The request the options describe; only what was given, so the protocol's defaults apply
    and its validation (exactly one input, ranges) speaks for itself."""
    request: dict[str, Any] = {}
    if args.prompt is not None:
        request["prompt"] = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.messages is not None:
        request["messages"] = _load_messages(args.messages)
    if args.input_ids is not None:
        request["input_ids"] = _parse_token_ids(args.input_ids)
    if getattr(args, "image", None):
        _add_images(request, [_read_image(path) for path in args.image])
    request.update({name: getattr(args, name) for name in REQUEST_OPTIONS if getattr(args, name) is not None})
    sampling = _sampling_from_args(args)
    if sampling:
        request["sampling"] = sampling
    constraint = _constraint_from_args(args)
    if constraint is not None:
        request["constraint"] = constraint
    if args.top_logprobs is not None:
        request["logprobs"] = True
        request["top_logprobs"] = args.top_logprobs
    return request


def _sampling_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """--sampling's JSON object (any sampling field: min_p, dry_multiplier, mirostat, ...), with the
    dedicated options (--temperature, --top-p, --top-k, --seed) over it."""
    sampling: Any = {}
    if args.sampling is not None:
        try:
            sampling = json.loads(args.sampling)
        except json.JSONDecodeError as error:
            raise UsageError(f"--sampling: not JSON ({error})") from None
        if not isinstance(sampling, dict):
            raise UsageError(f'--sampling: expected a JSON object such as {{"min_p": 0.05}}, got {args.sampling}')
    sampling.update({name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None})
    return sampling


def _constraint_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.json_schema is not None:
        try:
            schema = json.loads(_read_text(args.json_schema, "--json-schema"))
        except json.JSONDecodeError as error:
            raise UsageError(f"--json-schema {args.json_schema}: not JSON ({error})") from None
        return {"type": "json_schema", "json_schema": schema}
    if args.json_object:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    if args.choice:
        return {"type": "choice", "choices": args.choice}
    if args.grammar is not None:
        text = _read_text(args.grammar, "--grammar")
        return {"type": "grammar", "syntax": grammar_syntax(text), "grammar": text}
    return None


def _read_text(path: str, option: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"{option} {path}: {error}") from None


def _read_image(path: str) -> dict[str, Any]:
    """An image file as the protocol's ImageData: its bytes as base64 (the worker decodes and checks
    them; this command imports no Pillow), the media type guessed from the file name."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as error:
        raise UsageError(f"--image {path}: {error}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise UsageError(f"--image {path}: {len(data)} bytes, more than MAX_IMAGE_BYTES={MAX_IMAGE_BYTES}")
    media_type = mimetypes.guess_type(path)[0]
    image: dict[str, Any] = {"data": base64.b64encode(data).decode()}
    if media_type is not None and media_type.startswith("image/"):
        image["media_type"] = media_type
    return image


def _add_images(request: dict[str, Any], images: list[dict[str, Any]]) -> None:
    """`images` of a prompt request; a chat's go to its last user message as image parts, after its text."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        request["images"] = images  # the protocol refuses them with input_ids, naming the rule
        return
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise UsageError("--image: the chat (--messages) has no user message to attach images to")
    last = users[-1]
    content = last.get("content")
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    last["content"] = parts + [{"type": "image", **image} for image in images]


def _load_messages(path: str) -> Any:
    try:
        return json.loads(_read_text(path, "--messages"))
    except json.JSONDecodeError as error:
        raise UsageError(f"--messages {path}: {error}") from None


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--input-ids: expected comma-separated integers such as 1,2,3, got {text!r}") from None


# --- Output ----------------------------------------------------------------------


def _follow(handle: GenerationHandle, timeout: float | None, as_json: bool) -> int:
    """Print a request's text as it arrives (or its events as JSON lines); a status line at the end."""
    assembler = TextAssembler(handle.id)
    final: StreamEvent | None = None
    for event in handle.events(timeout=timeout):
        if event.is_terminal:
            final = event
        if as_json:
            print(event.to_json(), flush=True)
            if event.event == "error":
                raise GenerationError(event.error or "the generation failed", handle.id)
        else:
            _write(_next_text(assembler, event))
    assert final is not None  # events() ends only after a final event
    _end_line()
    _say(status_line(final))
    return EXIT_BY_FINISH_REASON[final.finish_reason or "error"]


def _next_text(assembler: TextAssembler, event: StreamEvent) -> str:
    """A redelivered request whose new attempt differs cannot be unprinted: say so, start over."""
    try:
        return assembler.feed(event)
    except StreamRestarted:
        _end_line()
        _say(f"[attempt {event.attempt}: the task was redelivered and generates a different text; restarting]")
        return assembler.reset()


def status_line(event: StreamEvent) -> str:
    """One line about how a request ended: `[done: length] 16 tokens in 0.21 s ...`."""
    parts = [f"[{event.event}: {event.finish_reason}]"]
    if event.usage is not None and event.timings is not None:
        usage, timings = event.usage, event.timings
        rate = usage.completion_tokens / timings.generate_s if timings.generate_s > 0 else 0.0
        parts.append(f"{usage.completion_tokens} tokens in {timings.generate_s:.2f} s ({rate:.1f} tokens/s);"
                     f" prompt {usage.prompt_tokens} tokens, {usage.cached_tokens} cached;"
                     f" queued {timings.queued_s:.2f} s, prefill {timings.prefill_s:.2f} s;")
    parts.append(f"id {event.id}, attempt {event.attempt}")
    return " ".join(parts)


def _print_result(result: GenerationResult, as_json: bool) -> int:
    if as_json:
        print(result.model_dump_json(), flush=True)
    elif result.choices is not None:
        for choice in result.choices:
            _end_line()
            _say(f"[sample {choice.index}: {choice.finish_reason}]")
            _write(choice.text)
        _end_line()
    else:
        _write(result.text)
        _end_line()
    if result.finish_reason == "cancelled":
        _say(f"[cancelled] {result.id}: {result.usage.completion_tokens} tokens generated before")
    elif result.finish_reason == "deadline":
        _say(f"[deadline] {result.id}: the deadline passed after {result.usage.completion_tokens} tokens")
    return EXIT_BY_FINISH_REASON[result.finish_reason]


class _Stdout:
    """The generated text exactly as generated (a pipe gets the result text byte for byte); on a
    terminal only, the last line is ended so that a shell prompt does not follow it."""

    def __init__(self) -> None:
        self.line_open = False

    def write(self, text: str) -> None:
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.line_open and sys.stdout.isatty():
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.line_open = False


_stdout = _Stdout()
_write = _stdout.write
_end_line = _stdout.end_line


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
