"""The `genq` command line. Subcommands import what they need lazily, so
commands that only talk to Redis never load torch."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

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
    from engine.tiny_model import make_tiny_model

    model_dir = Path(args.model) if args.model else DEFAULT_DEMO_MODEL
    if not (model_dir / "config.json").is_file():
        if args.model:
            print(f"error: {model_dir} has no config.json; pass an HF model directory", file=sys.stderr)
            return 2
        print(f"making the tiny demo model in {model_dir} (random weights: expect noise, not prose) ...",
              file=sys.stderr)
        make_tiny_model(model_dir, family="llama", preset="tiny")
    generator = Generator.from_pretrained(
        model_dir, device=args.device, progress=lambda done, total: print(
            f"loading weights: shard {done}/{total}", file=sys.stderr)
    )
    settings = SamplerSettings(temperature=args.temperature, top_p=0.95) if args.temperature > 0 else None
    for i, prompt in enumerate(DEMO_PROMPTS):
        generator.enqueue(Job(generator.tokenizer.encode(prompt), args.max_new_tokens, gen_settings=settings,
                              identifier=i, seed=i))
    texts = {i: prompt for i, prompt in enumerate(DEMO_PROMPTS)}
    start = time.monotonic()
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["stage"] == "streaming" or result["eos"]:
                texts[result["identifier"]] += result["text"]
            if result["eos"]:
                print(f"[{result['identifier']}] {texts[result['identifier']]!r} "
                      f"({result['new_tokens']} tokens, {result['eos_reason']})")
    elapsed = time.monotonic() - start
    stats = generator.stats
    print(f"{stats.generated_tokens} tokens in {elapsed:.2f} s ({stats.generated_tokens / elapsed:.1f} tokens/s) "
          f"over {stats.steps} steps", file=sys.stderr)
    return 0


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
    demo.add_argument("--model", help="HF model directory (default: the tiny demo model)")
    demo.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
