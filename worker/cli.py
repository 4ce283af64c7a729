"""The `genq` command line. Subcommands import what they need lazily, so
commands that only talk to Redis never load torch."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.plan import add_plan_command
from worker.settings import Settings
from worker.settings_cli import add_settings_options

if TYPE_CHECKING:
    from celery import Celery

DEFAULT_DEMO_MODEL = Path(".models/tiny-llama")
DEMO_PROMPTS = [
    "Once upon a time",
    "The key and value vectors",
    "Recipe for a simple bread:",
    "Weather report:",
]


def _make_tiny_model(args: argparse.Namespace) -> int:
    """write a random-weight HF model directory (tests, demo)

    Write a small random-weight Hugging Face model directory with a real byte-level BPE tokenizer and a chat
    template. Nothing is downloaded."""
    from genq_dev.tiny_model import count_parameters, make_tiny_model, model_config

    path = make_tiny_model(args.dir, family=args.family, preset=args.preset, seed=args.seed, dtype=args.dtype,
                           num_shards=args.shards)
    params = count_parameters(model_config(args.family, args.preset, dtype=args.dtype))
    print(f"wrote a random-weight {args.family} model ({params / 1e6:.1f}M parameters, preset {args.preset}) to {path}")
    return 0


def model_problem(model: str | Path | None) -> str | None:
    """Why `model` cannot be loaded at all, said before anything slow starts; None when it may be."""
    from engine.gguf_file import is_gguf

    if not model:
        return "no model: pass --model DIR or set GENQ_MODEL"
    if (Path(model) / "config.json").is_file() or is_gguf(model):
        return None
    return f"{model} is neither a Hugging Face model directory (no config.json) nor a .gguf file"


def _demo(args: argparse.Namespace) -> int:
    """stream a few completions from the engine (no Redis needed)

    Run a handful of prompts through the continuous-batching engine and print them. Without --model, makes
    the tiny demo model in .models/tiny-llama first."""
    from engine import Generator, Job, SamplerSettings
    from engine.progress import LoadProgress
    from genq_dev.tiny_model import make_tiny_model

    model_dir = Path(args.model or DEFAULT_DEMO_MODEL)
    problem = model_problem(model_dir)
    if problem and args.model:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if problem:
        print(f"making the tiny demo model in {model_dir} (random weights: expect noise, not prose) ...",
              file=sys.stderr)
        make_tiny_model(model_dir, family="llama", preset="tiny")
    generator = Generator.from_pretrained(model_dir, device=args.device, progress=LoadProgress())
    settings = SamplerSettings(temperature=args.temperature, top_p=0.95) if args.temperature > 0 else None
    for i, prompt in enumerate(DEMO_PROMPTS):
        generator.enqueue(Job(generator.tokenizer.encode(prompt), args.max_new_tokens, gen_settings=settings,
                              identifier=i, seed=i))
    texts = {i: prompt for i, prompt in enumerate(DEMO_PROMPTS)}
    start = time.monotonic()
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.stage == "streaming" or result.eos:
                texts[result.identifier] += result.text
            if result.eos:
                print(f"[{result.identifier}] {texts[result.identifier]!r} "
                      f"({result.new_tokens} tokens, {result.eos_reason})")
    elapsed = time.monotonic() - start
    stats = generator.stats
    print(f"{stats.generated_tokens} tokens in {elapsed:.2f} s ({stats.generated_tokens / elapsed:.1f} tokens/s) "
          f"over {stats.steps} steps", file=sys.stderr)
    return 0


def _apply_settings(args: argparse.Namespace, names: Sequence[str]) -> None:
    """Command-line options win over GENQ_* variables: export them before the
    Celery app (which reads Settings from the environment) is imported."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            os.environ[f"GENQ_{name.upper()}"] = json.dumps(value) if isinstance(value, list) else str(value)


def _worker(args: argparse.Namespace) -> int:
    """run a GPU (or CPU) worker: Celery threads pool + one engine loop

    Start a Celery worker that loads the model once, runs ONE engine loop owning the continuous-batching
    generator, and serves genq.generate tasks from the queue. Every option can also be set as GENQ_<NAME>
    (e.g. GENQ_REDIS_URL); options win."""
    _apply_settings(args, args.settings_fields)
    from worker.app import app

    settings = app.genq_settings
    problem = model_problem(settings.model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={settings.concurrency}",
        f"--queues={','.join(settings.queues)}",
        "--task-events",
        f"--loglevel={args.log_level.upper()}",
    ]
    if args.hostname:
        argv.append(f"--hostname={args.hostname}")
    return _run_worker(app, argv)


def _run_worker(app: Celery, argv: list[str]) -> int:
    """Run the Celery worker and return ITS exit status: worker_main drops it,
    so a worker that stopped on an unrecoverable error would exit 0 and defeat
    `restart: on-failure`. The status is read where Celery announces the shutdown."""
    from celery.signals import worker_shutdown

    codes: list[int] = []

    def record(sender: object = None, **_: object) -> None:
        codes.append(getattr(sender, "exitcode", None) or 0)

    worker_shutdown.connect(record, weak=False)
    app.worker_main(argv)
    return max(codes, default=0)


def _flower(args: argparse.Namespace) -> int:
    """run Flower against the genq Celery app

    Start Flower (the Celery monitor) for the genq app. Its /api needs basic auth
    (FLOWER_BASIC_AUTH=user:pass) or FLOWER_UNAUTHENTICATED_API=true."""
    _apply_settings(args, ("redis_url", "queue"))
    command = [sys.executable, "-m", "celery", "-A", "worker.app", "flower", f"--port={args.port}",
               f"--address={args.address}"]
    os.execvp(command[0], command)


def _gateway(args: argparse.Namespace) -> int:
    """run the HTTP gateway: webhooks, SSE streams, OpenAI-compatible API (no torch needed)

    Serve the FastAPI gateway with uvicorn. Settings come from GENQ_GATEWAY_* and the shared GENQ_*
    variables (docs/configuration.md); --host and --port win."""
    from producer.gateway.server import serve

    serve(args.host, args.port, args.log_level)
    return 0


def _callback_worker(args: argparse.Namespace) -> int:
    """run the CPU worker that delivers completion callbacks (no torch needed)

    A Celery threads-pool worker on GENQ_CALLBACK_QUEUE (default genq-callbacks) running
    genq.deliver_callback: signed POSTs with retries and exponential backoff."""
    from producer.callbacks import main as callback_worker

    callback_worker([f"--loglevel={args.log_level.upper()}"])
    return 0


def _dev(args: argparse.Namespace) -> int:
    """the whole service on this machine: Redis, worker, Flower, a streamed demo (make run)

    Start Redis (GENQ_REDIS_URL if set and reachable, else a private redis-server on a free port), fetch the
    SmolLM2 demo model unless --model is given, start a worker and Flower, send one demo chat question and
    stream the answer to the terminal, then keep serving until Ctrl-C, which stops everything it started."""
    from worker.dev import run

    return run(args.model, args.demo_tokens, args.flower_port)


DEFAULT_LOG_LEVELS = {"gateway": "INFO"}
"""A gateway says where it listens and logs each request (tokens redacted) unless told otherwise,
as uvicorn does on its own."""


def _command(commands: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int],
             summary: str | None = None, description: str | None = None, **options: Any) -> argparse.ArgumentParser:
    """The subcommand `name`, which runs func(args); its summary and description are by default func's
    docstring (its first line, and the paragraph after it), so a command is documented in one place."""
    first, _, rest = inspect.cleandoc(func.__doc__ or "").partition("\n\n")
    command: argparse.ArgumentParser = commands.add_parser(
        name, help=summary or first, description=description or " ".join(rest.split()), **options)
    command.set_defaults(func=func)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genq", description="Queue-fed LLM generation service.")
    parser.add_argument("--log-level", help="logging level (DEBUG, INFO, WARNING, ...; default INFO for `genq "
                                            "gateway`, whose address and access log are INFO lines, else WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = _command(commands, "make-tiny-model", _make_tiny_model)
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--family", choices=["llama", "mistral", "qwen2", "qwen3"], default="llama")
    tiny.add_argument("--preset", choices=["test", "tiny", "small"], default="tiny",
                      help="size: test (unit tests), tiny (~5M parameters), small (~40M)")
    tiny.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shards", type=int, default=1, help="number of safetensors shards (index written if > 1)")

    demo = _command(commands, "demo", _demo)
    demo.add_argument("--model", help="HF model directory or .gguf file (default: the tiny demo model)")
    demo.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")

    worker = _command(commands, "worker", _worker)
    settings_fields = add_settings_options(worker, Settings)
    worker.add_argument("--hostname", help="Celery node name (default genq worker's celery@host)")
    worker.set_defaults(settings_fields=settings_fields)

    flower = _command(commands, "flower", _flower)
    flower.add_argument("--port", type=int, default=5555)
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--redis-url", help="broker URL (GENQ_REDIS_URL)")
    flower.add_argument("--queue", help="queue name (GENQ_QUEUE)")

    gateway = _command(commands, "gateway", _gateway)
    gateway.add_argument("--host", help="bind address (GENQ_GATEWAY_HOST, default 127.0.0.1)")
    gateway.add_argument("--port", type=int, help="bind port (GENQ_GATEWAY_PORT, default 8000)")

    _command(commands, "callback-worker", _callback_worker)

    dev = _command(commands, "dev", _dev)
    dev.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct, fetched "
                                     "once into .models/; the tiny random model if that fails)")
    dev.add_argument("--demo-tokens", type=int, default=256, help="most tokens in the demo answer")
    dev.add_argument("--flower-port", type=int, help="default: a free port")
    add_plan_command(commands)
    _add_producer_commands(commands)
    return parser


PRODUCER_EXIT_CODES = """exit codes:
  0    done: a stop condition or max_new_tokens ended the generation
  1    the generation failed (the worker's message is on stderr)
  2    usage or validation error (the protocol's message is on stderr)
  3    cancelled
  4    timed out: the request's deadline passed, or no result within the wait
  5    cannot reach Redis (or the broker)
  130  interrupted (Ctrl-C); `genq submit` cancels its request first
"""


def _producer_command(args: argparse.Namespace) -> int:
    """producer.cli runs these commands, imported only then: they need neither torch nor the worker."""
    from producer.cli import run

    return run(args)


def _add_producer_commands(commands: argparse._SubParsersAction) -> None:
    """submit, stream, cancel, result, adapters, keys: what a backend script (or its operator) needs, through
    the client library."""

    def add(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        parser = _command(commands, name, _producer_command, summary, description, epilog=PRODUCER_EXIT_CODES,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--redis-url", help="streams, broker and results (GENQ_REDIS_URL)")
        return parser

    submit = add(
        "submit", "send a generation request and print its text",
        "Send a genq.generate task and wait for it: without --stream, print the request id on stderr and the "
        "result text on stdout; with --stream, print the text as it is generated and a status line on stderr. "
        "Exactly one input: PROMPT, --messages or --input-ids.",
    )
    submit.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin")
    submit.add_argument("--messages", metavar="FILE", help='chat: a JSON list of {"role", "content"}; - = stdin')
    submit.add_argument("--input-ids", metavar="IDS", help="token ids, comma-separated: 1,2,3")
    submit.add_argument("--image", action="append", metavar="PATH",
                        help="an image file (PNG, JPEG, WebP, ...) for a vision model; repeat for several, in order. "
                             "With PROMPT, the prompt marks each with the model's image placeholder (the model card's "
                             "images.placeholder, e.g. <image>); with --messages, they are appended to the last user "
                             "message as image parts. The worker decodes and checks them")
    submit.add_argument("--stream", action="store_true", help="print the text as it is generated")
    submit.add_argument("--json", action="store_true",
                        help="print the result as JSON (with --stream: every event, one JSON object a line)")
    submit.add_argument("--detach", action="store_true", help="print the request id on stdout and exit at once")
    submit.add_argument("--max-new-tokens", type=int, metavar="N", help="default 256")
    submit.add_argument("--min-new-tokens", type=int, metavar="N", help="stop tokens blocked until then")
    submit.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (the default)")
    submit.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass")
    submit.add_argument("--top-k", type=int, metavar="K", help="keep the K most likely tokens")
    submit.add_argument("--seed", type=int, metavar="N", help="same seed and request, same text")
    submit.add_argument("--sampling", metavar="JSON",
                        help='any other sampling settings, as a JSON object: \'{"min_p": 0.05, "dry_multiplier": '
                             '0.8, "mirostat": true}\' (docs/protocol.md lists them)')
    submit.add_argument("--stop", action="append", metavar="STR", help="a stop string (repeatable)")
    submit.add_argument("--ignore-eos", action="store_const", const=True, help="do not stop at EOS")
    submit.add_argument("--ban", action="append", dest="banned_strings", metavar="STR",
                        help="a string the output never contains (repeatable; the worker rewinds)")
    submit.add_argument("--token-healing", action="store_const", const=True,
                        help="regenerate the prompt's last token (for prompts cut mid-word)")
    submit.add_argument("--n", type=int, metavar="N",
                        help="N samples of the prompt (1 to 16; seeds seed, seed + 1, ...), each printed under "
                             "a [sample i] line")
    submit.add_argument("--id", dest="identifier", metavar="ID", help="the request identifier (default: a new UUID)")
    submit.add_argument("--priority", type=int, metavar="P", help="0 (served first) to 9")
    submit.add_argument("--max-skips", type=int, metavar="N",
                        help="times the request may be passed over while it does not fit the cache (0 to 1024; "
                             "default: the worker's, 16)")
    submit.add_argument("--timeout", type=float, metavar="S",
                        help="deadline S seconds from now: the generation stops there (exit 4); the request is "
                             "cancelled if no result comes")
    submit.add_argument("--queue", help="the queue of the model to use (GENQ_QUEUE, default genq)")
    submit.add_argument("--adapter", metavar="NAME", help="generate with this LoRA adapter loaded on the workers "
                                                          "(the model card's adapters); default: the base model")
    constraint = submit.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE",
                            help="the output is JSON valid under this JSON Schema (a file; - = stdin)")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    constraint.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is one of these (repeat the option for each choice)")
    constraint.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar")
    submit.add_argument("--top-logprobs", type=int, metavar="K",
                        help="with --json: each token's log-probability and K alternatives (0 to 20)")

    stream = add("stream", "print a request's text from the start, as it is generated",
                 "Follow a request sent by anyone: its text so far from the replay stream, then live.")
    stream.add_argument("id", help="the request identifier")
    stream.add_argument("--json", action="store_true", help="every event, one JSON object a line")
    stream.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds without an event")

    cancel = add("cancel", "cancel a queued or running request",
                 "Cancel a request: a queued one never runs, a running one stops within one engine step. "
                 "Cancelling a finished or unknown request does nothing.")
    cancel.add_argument("id", help="the request identifier")

    adapters = add("adapters", "load or unload a LoRA adapter on the workers of a queue",
                   "Send a control message to the workers of a queue: load a PEFT adapter directory under a name "
                   "(PATH is a path on the workers' machines), or unload one (requests naming it are refused from "
                   "then on; those already running finish). Fire and forget: the model card lists the adapters.")
    adapters.add_argument("--queue", help="the queue whose workers load or unload it (GENQ_QUEUE, default genq)")
    action = adapters.add_subparsers(dest="action", required=True)
    load = action.add_parser("load", help="load PATH under NAME")
    load.add_argument("name", help="the adapter's name, which requests give in `adapter`")
    load.add_argument("path", help="the PEFT adapter directory, on the workers' machines")
    unload = action.add_parser("unload", help="unload NAME")
    unload.add_argument("name", help="the adapter's name")

    keys = add("keys", "create, list, rotate or revoke the gateway's API keys (tenants)",
               "Manage the API keys the gateway accepts besides GENQ_GATEWAY_TOKEN (docs/gateway.md, Tenants and API "
               "keys). Each key belongs to a tenant: its requests run and are counted as that tenant's, within the "
               "key's limits (per key; left out: unlimited), and it sees only its tenant's tasks. A key is shown "
               "once, by create and rotate; Redis keeps only its SHA-256. Revoking or rotating takes effect at the "
               "next request on every gateway.")
    key_action = keys.add_subparsers(dest="action", required=True)
    create = key_action.add_parser("create", help="a new key of a tenant; prints the key (once) on stdout")
    create.add_argument("--tenant", required=True, help="the tenant the key's requests count under (the identifier "
                                                        "rule: letters, digits, '_.:-', at most 128)")
    create.add_argument("--name", help="a label for the operator (`keys list` shows it)")
    create.add_argument("--rpm", type=int, metavar="N", help="at most N requests in any 60 s (429 past it)")
    create.add_argument("--tpm", type=int, metavar="N",
                        help="tokens per minute: a request reserves its prompt tokens + n * max tokens at admission "
                             "(429 when the bucket lacks them); what the task did not use is given back at its end")
    create.add_argument("--concurrent", type=int, metavar="N", help="at most N of the key's tasks queued or "
                                                                    "running at once (429 past it)")
    create.add_argument("--max-priority", type=int, metavar="P",
                        help="the best priority (0 is served first, 9 last) the key's requests get: a better or no "
                             "priority is clamped to P")
    key_action.add_parser("list", help="every key's record as one JSON object a line (never the key itself)")
    rotate = key_action.add_parser("rotate", help="a new key for ID (same tenant, limits and usage); the old key "
                                                  "stops working at once")
    rotate.add_argument("id", help="the key's id (`keys list`)")
    revoke = key_action.add_parser("revoke", help="refuse ID from now on (its record and usage stay)")
    revoke.add_argument("id", help="the key's id (`keys list`)")

    result = add("result", "print a request's result", "Print the result of a request from the result backend.")
    result.add_argument("id", help="the request identifier")
    result.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for it to finish (default: do not wait)")
    result.add_argument("--json", action="store_true", help="print the whole result as JSON")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_level = args.log_level or DEFAULT_LOG_LEVELS.get(args.command, "WARNING")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
