"""The `genq` command line. Subcommands import what they need lazily, so
commands that only talk to Redis never load torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

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
    from engine.tiny_model import count_parameters, make_tiny_model, model_config

    path = make_tiny_model(args.dir, family=args.family, preset=args.preset, seed=args.seed, dtype=args.dtype,
                           num_shards=args.shards)
    params = count_parameters(model_config(args.family, args.preset, dtype=args.dtype))
    print(f"wrote a random-weight {args.family} model ({params / 1e6:.1f}M parameters, preset {args.preset}) to {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from engine import Generator, Job, SamplerSettings
    from engine.gguf_file import is_gguf
    from engine.progress import LoadProgress
    from engine.tiny_model import make_tiny_model

    model_dir = Path(args.model) if args.model else DEFAULT_DEMO_MODEL
    if not (model_dir / "config.json").is_file() and not is_gguf(model_dir):
        if args.model:
            print(f"error: {model_dir} is neither an HF model directory (no config.json) nor a .gguf file",
                  file=sys.stderr)
            return 2
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


def _apply_settings(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Command-line options win over GENQ_* variables: export them before the
    Celery app (which reads Settings from the environment) is imported."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            os.environ[f"GENQ_{name.upper()}"] = str(value)


def _worker(args: argparse.Namespace) -> int:
    _apply_settings(args, WORKER_SETTINGS)
    from worker.app import app

    settings = app.genq_settings
    if not settings.model:
        print("error: no model: pass --model DIR or set GENQ_MODEL", file=sys.stderr)
        return 2
    from engine.gguf_file import is_gguf

    if not (Path(settings.model) / "config.json").is_file() and not is_gguf(settings.model):
        print(f"error: {settings.model} is neither a Hugging Face model directory (no config.json) nor a .gguf file",
              file=sys.stderr)
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
    _apply_settings(args, ("redis_url", "queue"))
    command = [sys.executable, "-m", "celery", "-A", "worker.app", "flower", f"--port={args.port}",
               f"--address={args.address}"]
    os.execvp(command[0], command)


def _gateway(args: argparse.Namespace) -> int:
    from producer.gateway.server import serve

    serve(args.host, args.port, args.log_level)
    return 0


def _callback_worker(args: argparse.Namespace) -> int:
    from producer.callbacks import main as callback_worker

    callback_worker([f"--loglevel={args.log_level.upper()}"])
    return 0


def _dev(args: argparse.Namespace) -> int:
    from worker.dev import run

    return run(args.model, args.demo_tokens, args.flower_port)


WORKER_SETTINGS = (
    "model", "device", "dtype", "concurrency", "queue", "redis_url", "cache_tokens", "cache_dtype", "quantize",
    "page_size",
    "max_batch_size", "max_chunk_size", "visibility_timeout_s", "shutdown_grace_s", "metrics_port",
    "prefix_routes", "prefix_route", "prefix_caching", "ngram_draft", "draft_model", "num_draft_tokens",
    "max_speculative_batch",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genq", description="Queue-fed LLM generation service.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a random-weight HF model directory (tests, demo)",
        description="Write a small random-weight Hugging Face model directory with a real byte-level BPE "
                    "tokenizer and a chat template. Nothing is downloaded.",
    )
    tiny.add_argument("dir", help="output directory")
    tiny.add_argument("--family", choices=["llama", "mistral", "qwen2", "qwen3"], default="llama")
    tiny.add_argument("--preset", choices=["test", "tiny", "small"], default="tiny",
                      help="size: test (unit tests), tiny (~5M parameters), small (~40M)")
    tiny.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--shards", type=int, default=1, help="number of safetensors shards (index written if > 1)")
    tiny.set_defaults(func=_make_tiny_model)

    demo = commands.add_parser(
        "demo", help="stream a few completions from the engine (no Redis needed)",
        description="Run a handful of prompts through the continuous-batching engine and print them. "
                    "Without --model, makes the tiny demo model in .models/tiny-llama first.",
    )
    demo.add_argument("--model", help="HF model directory or .gguf file (default: the tiny demo model)")
    demo.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    demo.set_defaults(func=_demo)

    worker = commands.add_parser(
        "worker", help="run a GPU (or CPU) worker: Celery threads pool + one engine loop",
        description="Start a Celery worker that loads the model once, runs ONE engine loop owning the "
                    "continuous-batching generator, and serves genq.generate tasks from the queue. Every "
                    "option can also be set as GENQ_<NAME> (e.g. GENQ_REDIS_URL); options win.",
    )
    worker.add_argument("--model", help="HF model directory or .gguf file (GENQ_MODEL)")
    worker.add_argument("--device", help="cpu or cuda[:N] (default cpu)")
    worker.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's")
    worker.add_argument("--concurrency", type=int, help="tasks in flight on this worker (default 64)")
    worker.add_argument("--queue", help="queue to consume; one per model (default genq)")
    worker.add_argument("--redis-url", dest="redis_url", help="broker + results + streams (GENQ_REDIS_URL)")
    worker.add_argument("--cache-tokens", dest="cache_tokens", type=int, help="KV cache size in tokens")
    worker.add_argument("--cache-dtype", dest="cache_dtype", choices=["auto", "fp8", "q8", "q4", "k8v4"],
                        help="KV cache storage (GENQ_CACHE_DTYPE): auto = the model's dtype; fp8, q8, q4 and "
                             "k8v4 (keys 8-bit, values 4-bit) are quantized on write: 2x to 3.5x the tokens of "
                             "a 16-bit cache in the same memory (see the README's quantization table)")
    worker.add_argument("--quantize", choices=["int8", "int4"],
                        help="weight-only quantization of the linear layers at load (GENQ_QUANTIZE); a GGUF "
                             "Q4_0/Q4_1/Q4_K/Q8_0 file maps onto it without dequantizing first")
    worker.add_argument("--page-size", dest="page_size", type=int, help="KV cache page size in tokens")
    worker.add_argument("--max-batch-size", dest="max_batch_size", type=int, help="jobs batched together")
    worker.add_argument("--max-chunk-size", dest="max_chunk_size", type=int, help="tokens per forward")
    worker.add_argument("--visibility-timeout", dest="visibility_timeout_s", type=int,
                        help="seconds before an unacked task is redelivered (default 3600)")
    worker.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float,
                        help="seconds a warm shutdown lets in-flight jobs finish before requeueing them")
    worker.add_argument("--metrics-port", dest="metrics_port", type=int,
                        help="serve Prometheus metrics at http://0.0.0.0:PORT/metrics (GENQ_METRICS_PORT)")
    worker.add_argument("--prefix-routes", dest="prefix_routes", type=int,
                        help="number of prefix routes the producers use (GENQ_PREFIX_ROUTES; 0 = off)")
    worker.add_argument("--prefix-route", dest="prefix_route",
                        help="prefix routes this worker also consumes, e.g. 0 or 0,1 (GENQ_PREFIX_ROUTE): "
                             "requests starting alike reach the same worker, so its prefix cache hits")
    worker.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_const", const=False,
                        help="do not share KV pages between requests with a common prefix (GENQ_PREFIX_CACHING)")
    speculation = worker.add_mutually_exclusive_group()
    speculation.add_argument("--ngram-draft", dest="ngram_draft", action="store_const", const=True,
                             help="speculative decoding with n-gram drafts from each request's own text "
                                  "(GENQ_NGRAM_DRAFT); pays on repetitive output at small batches")
    speculation.add_argument("--draft-model", dest="draft_model", metavar="PATH",
                             help="speculative decoding with a smaller model of the same tokenizer "
                                  "(GENQ_DRAFT_MODEL)")
    worker.add_argument("--num-draft-tokens", dest="num_draft_tokens", type=int,
                        help="draft tokens verified per request and step (default 4)")
    worker.add_argument("--max-speculative-batch", dest="max_speculative_batch", type=int,
                        help="speculate only while at most this many requests decode (default 8)")
    worker.add_argument("--hostname", help="Celery node name (default genq worker's celery@host)")
    worker.set_defaults(func=_worker)

    flower = commands.add_parser(
        "flower", help="run Flower against the genq Celery app",
        description="Start Flower (the Celery monitor) for the genq app. Its /api needs basic auth "
                    "(FLOWER_BASIC_AUTH=user:pass) or FLOWER_UNAUTHENTICATED_API=true.",
    )
    flower.add_argument("--port", type=int, default=5555)
    flower.add_argument("--address", default="127.0.0.1")
    flower.add_argument("--redis-url", dest="redis_url", help="broker URL (GENQ_REDIS_URL)")
    flower.add_argument("--queue", help="queue name (GENQ_QUEUE)")
    flower.set_defaults(func=_flower)

    gateway = commands.add_parser(
        "gateway", help="run the HTTP gateway: webhooks, SSE streams, OpenAI-compatible API (no torch needed)",
        description="Serve the FastAPI gateway with uvicorn. Settings come from GENQ_GATEWAY_* and the shared "
                    "GENQ_* variables (README, 'The gateway'); --host and --port win.",
    )
    gateway.add_argument("--host", help="bind address (GENQ_GATEWAY_HOST, default 127.0.0.1)")
    gateway.add_argument("--port", type=int, help="bind port (GENQ_GATEWAY_PORT, default 8000)")
    gateway.set_defaults(func=_gateway)

    callbacks = commands.add_parser(
        "callback-worker", help="run the CPU worker that delivers completion callbacks (no torch needed)",
        description="A Celery threads-pool worker on GENQ_CALLBACK_QUEUE (default genq-callbacks) running "
                    "genq.deliver_callback: signed POSTs with retries and exponential backoff.",
    )
    callbacks.set_defaults(func=_callback_worker)

    dev = commands.add_parser(
        "dev", help="the whole service on this machine: Redis, worker, Flower, a streamed demo (make run)",
        description="Start Redis (GENQ_REDIS_URL if set and reachable, else a private redis-server on a free "
                    "port), fetch the SmolLM2 demo model unless --model is given, start a worker and Flower, "
                    "send one demo chat question and stream the answer to the terminal, then keep serving "
                    "until Ctrl-C, which stops everything it started.",
    )
    dev.add_argument("--model", help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct, fetched "
                                     "once into .models/; the tiny random model if that fails)")
    dev.add_argument("--demo-tokens", dest="demo_tokens", type=int, default=256,
                     help="most tokens in the demo answer")
    dev.add_argument("--flower-port", dest="flower_port", type=int, help="default: a free port")
    dev.set_defaults(func=_dev)
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


def _producer_command(name: str) -> Callable[[argparse.Namespace], int]:
    """A handler from producer.cli, imported when it runs: these commands need neither torch nor the worker."""

    def run(args: argparse.Namespace) -> int:
        from producer import cli

        return getattr(cli, name)(args)

    return run


def _add_producer_commands(commands: argparse._SubParsersAction) -> None:
    """submit, stream, cancel, result: what a backend script needs, through the client library."""

    def add(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=summary, description=description, epilog=PRODUCER_EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--redis-url", dest="redis_url", help="streams, broker and results (GENQ_REDIS_URL)")
        parser.set_defaults(func=_producer_command(f"{name}_command"))
        return parser

    submit = add(
        "submit", "send a generation request and print its text",
        "Send a genq.generate task and wait for it: without --stream, print the request id on stderr and the "
        "result text on stdout; with --stream, print the text as it is generated and a status line on stderr. "
        "Exactly one input: PROMPT, --messages or --input-ids.",
    )
    submit.add_argument("prompt", nargs="?", help="the prompt; - reads it from stdin")
    submit.add_argument("--messages", metavar="FILE", help='chat: a JSON list of {"role", "content"}; - = stdin')
    submit.add_argument("--input-ids", dest="input_ids", metavar="IDS", help="token ids, comma-separated: 1,2,3")
    submit.add_argument("--stream", action="store_true", help="print the text as it is generated")
    submit.add_argument("--json", action="store_true",
                        help="print the result as JSON (with --stream: every event, one JSON object a line)")
    submit.add_argument("--detach", action="store_true", help="print the request id on stdout and exit at once")
    submit.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, metavar="N", help="default 256")
    submit.add_argument("--min-new-tokens", dest="min_new_tokens", type=int, metavar="N",
                        help="stop tokens blocked until then")
    submit.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (the default)")
    submit.add_argument("--top-p", dest="top_p", type=float, metavar="P", help="nucleus sampling mass")
    submit.add_argument("--top-k", dest="top_k", type=int, metavar="K",
                        help="keep the K most likely tokens")
    submit.add_argument("--seed", type=int, metavar="N", help="same seed and request, same text")
    submit.add_argument("--sampling", metavar="JSON",
                        help='any other sampling settings, as a JSON object: \'{"min_p": 0.05, "dry_multiplier": '
                             '0.8, "mirostat": true}\' (docs/protocol.md lists them)')
    submit.add_argument("--stop", action="append", metavar="STR", help="a stop string (repeatable)")
    submit.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", help="do not stop at EOS")
    submit.add_argument("--ban", action="append", metavar="STR",
                        help="a string the output never contains (repeatable; the worker rewinds)")
    submit.add_argument("--token-healing", dest="token_healing", action="store_true",
                        help="regenerate the prompt's last token (for prompts cut mid-word)")
    submit.add_argument("--n", type=int, metavar="N",
                        help="N samples of the prompt (1 to 16; seeds seed, seed + 1, ...), each printed under "
                             "a [sample i] line")
    submit.add_argument("--id", help="the request identifier (default: a new UUID)")
    submit.add_argument("--priority", type=int, metavar="P", help="0 (served first) to 9")
    submit.add_argument("--max-skips", dest="max_skips", type=int, metavar="N",
                        help="times the request may be passed over while it does not fit the cache (0 to 1024; "
                             "default: the worker's, 16)")
    submit.add_argument("--timeout", type=float, metavar="S",
                        help="deadline S seconds from now: the generation stops there (exit 4); the request is "
                             "cancelled if no result comes")
    submit.add_argument("--queue", help="the queue of the model to use (GENQ_QUEUE, default genq)")
    constraint = submit.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", dest="json_schema", metavar="FILE",
                            help="the output is JSON valid under this JSON Schema (a file; - = stdin)")
    constraint.add_argument("--json-object", dest="json_object", action="store_true",
                            help="the output is a JSON object")
    constraint.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    constraint.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is one of these (repeat the option for each choice)")
    constraint.add_argument("--grammar", metavar="FILE", help="the output follows this Lark or GBNF grammar")
    submit.add_argument("--top-logprobs", dest="top_logprobs", type=int, metavar="K",
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

    result = add("result", "print a request's result", "Print the result of a request from the result backend.")
    result.add_argument("id", help="the request identifier")
    result.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for it to finish (default: do not wait)")
    result.add_argument("--json", action="store_true", help="print the whole result as JSON")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
