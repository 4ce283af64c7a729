"""xgrammar or llguidance for constrained decoding? (issue 11: pick by
measured mask time per token and correctness, and write the reason down.)

Both libraries compile a grammar for a `tokenizers` vocabulary and produce,
per decoding step, a bitmask of the tokens that keep the output inside the
grammar. On the real model's vocabulary (SmolLM2-135M-Instruct, 49,152
tokens) and for each constraint kind, this replays documents known to be
valid token by token, as a decoding loop would: compute the mask (timed),
check that the document's next token is allowed, advance the matcher. It
also checks that tokens which would break the grammar are refused, and that
the matcher accepts at the end of each document. Compile times are measured
cold and with the library's own cache warm.

Writes bench/results/grammar_libraries.{json,png} and prints a markdown table.
Needs both libraries installed (they are not dependencies of genq until one
is chosen): `pip install xgrammar llguidance`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from bench_common import RESULTS_DIR, bar_chart, bench_main, machine_info, progress, table_lines

from engine.tokenizer import Tokenizer

matplotlib.use("Agg")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
REGEX = r"[A-Z]{3}-[0-9]{4}-(alpha|beta|gamma)"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Émile Zola", "李小龙", "Katherine Johnson",
         "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth", "Margaret Hamilton"]


def documents() -> dict[str, list[str]]:
    """Valid outputs for each constraint (the JSON ones in the compact form a model writes)."""
    people = [
        {"name": name, "age": 20 + 7 * i, **({"email": f"p{i}@example.org"} if i % 2 else {}),
         "tags": [f"tag{j}" for j in range(i % 4)], "address": {"city": "Paris", "zip": f"{75000 + i}"},
         "active": i % 3 == 0}
        for i, name in enumerate(NAMES)
    ]
    return {
        "json_schema": [json.dumps(p, ensure_ascii=False, separators=(",", ":")) for p in people],
        "regex": [f"ABC-{1000 + 37 * i}-{['alpha', 'beta', 'gamma'][i % 3]}" for i in range(10)],
        "choice": CHOICES,
    }


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance
        import llguidance.torch

        self.lib = llguidance
        self.fill = llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                                eos_token=tokenizer.eos_token_id)
        self.mask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, kind: str) -> Any:
        matcher = self.lib.LLMatcher
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(json.dumps(SCHEMA))
        if kind == "regex":
            return matcher.grammar_from_regex(REGEX)
        return matcher.grammar_from_regex("(" + "|".join(c.replace(" ", "\\ ") for c in CHOICES) + ")")

    def matcher(self, grammar: Any) -> Any:
        matcher = self.lib.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def allowed(self, matcher: Any) -> torch.Tensor:
        self.fill(matcher, self.mask, 0)
        return self.mask[0]

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.lib = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size,
                                                       stop_token_ids=[tokenizer.eos_token_id])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
        self.mask = xgrammar.allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, kind: str) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                     separators=(",", ":"))
        if kind == "regex":
            return self.compiler.compile_regex(REGEX)
        return self.compiler.compile_regex("(" + "|".join(CHOICES) + ")")

    def matcher(self, grammar: Any) -> Any:
        return self.lib.GrammarMatcher(grammar)

    def allowed(self, matcher: Any) -> torch.Tensor:
        matcher.fill_next_token_bitmask(self.mask, 0)
        return self.mask[0]

    def advance(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))



def bit(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def replay(library: Any, grammar: Any, ids: list[int], wrong: list[int], eos: int) -> dict[str, Any]:
    """One document through a fresh matcher: mask times, refusals of the document's own tokens
    (must be 0), tokens that cannot start a document but are allowed there (must be 0), and
    whether EOS is allowed at its end."""
    matcher = library.matcher(grammar)
    times: list[float] = []
    refused = 0
    allowed_wrong = -1
    for token in ids:
        start = time.perf_counter()
        mask = library.allowed(matcher)
        times.append(time.perf_counter() - start)
        if allowed_wrong < 0:
            allowed_wrong = sum(bit(mask, t) for t in wrong)
        refused += not bit(mask, token)
        if not library.advance(matcher, token):
            refused += 1
            break
    return {"times": times, "refused": refused, "allowed_wrong": allowed_wrong,
            "accepting": bit(library.allowed(matcher), eos)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from genq_dev.demo_model import fetch_smollm2

    tokenizer = Tokenizer.from_pretrained(args.gguf or fetch_smollm2())
    docs = documents()
    # Tokens none of the constraints allows as the first token of a document.
    never = sorted({ids[0] for word in ("}{", "@@", "hello", " xyz", "}", tokenizer.eos_token or "")
                    if word and (ids := tokenizer.encode(word, add_special_tokens=False))})
    results: dict[str, Any] = {"method": __doc__, "machine": machine_info(), "vocab_size": tokenizer.vocab_size,
                               "libraries": {}}
    for factory in (Llguidance, Xgrammar):
        started = time.perf_counter()
        library = factory(tokenizer)
        setup_s = time.perf_counter() - started
        progress(f"{library.name}: tokenizer set up in {setup_s:.2f} s")
        per_kind = {}
        for kind, texts in docs.items():
            started = time.perf_counter()
            grammar = library.compile(kind)
            cold_s = time.perf_counter() - started
            started = time.perf_counter()
            library.compile(kind)
            warm_s = time.perf_counter() - started
            runs = [replay(library, grammar, tokenizer.encode(text, add_special_tokens=False),
                           never, tokenizer.eos_token_id) for text in texts]
            times = [t for r in runs for t in r["times"]]
            per_kind[kind] = {
                "compile_cold_ms": round(cold_s * 1e3, 2),
                "compile_warm_ms": round(warm_s * 1e3, 3),
                "tokens": len(times),
                "mask_us_mean": round(statistics.fmean(times) * 1e6, 1),
                "mask_us_p50": round(statistics.median(times) * 1e6, 1),
                "mask_us_p99": round(sorted(times)[int(0.99 * (len(times) - 1))] * 1e6, 1),
                "refused_valid_tokens": sum(r["refused"] for r in runs),
                "allowed_invalid_tokens": sum(r["allowed_wrong"] for r in runs),
                "accepting_at_end": sum(r["accepting"] for r in runs),
                "documents": len(runs),
            }
            progress(f"  {kind}: {per_kind[kind]}")
        results["libraries"][library.name] = {"tokenizer_setup_s": round(setup_s, 3), "kinds": per_kind}
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    libraries = list(results["libraries"])
    kinds = list(next(iter(results["libraries"].values()))["kinds"])
    bar_chart(path, kinds, {name: [results["libraries"][name]["kinds"][k]["mask_us_mean"] for k in kinds]
                            for name in libraries},
              "mean mask time per token (µs)", f"token bitmask, vocabulary {results['vocab_size']}", (7, 4))


def table(results: dict[str, Any]) -> str:
    return "\n".join(table_lines(
        ["library", "constraint", "compile cold / cached (ms)", "mask µs mean / p50 / p99", "tokens", "valid refused",
         "invalid allowed", "accepting at end"], "llrrrrrr",
        [[name, kind, f"{k['compile_cold_ms']} / {k['compile_warm_ms']}",
          f"{k['mask_us_mean']} / {k['mask_us_p50']} / {k['mask_us_p99']}", k["tokens"], k["refused_valid_tokens"],
          k["allowed_invalid_tokens"], f"{k['accepting_at_end']}/{k['documents']}"]
         for name, data in results["libraries"].items() for kind, k in data["kinds"].items()]))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="model file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


main = bench_main("grammar_libraries", parse_args, run, plot, table)


if __name__ == "__main__":
    main()
