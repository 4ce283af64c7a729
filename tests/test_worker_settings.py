"""Worker Settings as the one source of the engine's config and of `genq worker`'s options."""

from __future__ import annotations

import argparse
import re
from typing import get_args

import pytest

from engine.engine_config import CacheConfig, CacheDtype, EngineConfig, Quantization, SchedulerConfig, SpeculativeConfig
from worker.cli import _apply_settings, build_parser
from worker.settings import Settings
from worker.settings_cli import CLIENT_ONLY, env_name


def test_every_engine_setting_reaches_the_engine_config():
    settings = Settings(model="m", cache_tokens=4096, cache_dtype="q4", quantize="int8", page_size=32,
                        max_batch_size=8, max_chunk_size=256, concurrency=512, prefix_caching=False, ngram_draft=True,
                        num_draft_tokens=3, max_speculative_batch=2)
    assert settings.engine_config() == EngineConfig(
        cache=CacheConfig(page_size=32, cache_tokens=4096, cache_dtype="q4", prefix_caching=False),
        scheduler=SchedulerConfig(max_batch_size=8, max_chunk_size=256, max_pending=2048),
        speculative=SpeculativeConfig(use_ngram_draft=True, num_draft_tokens=3, max_speculative_batch=2),
        quantize="int8",
    )


def test_unset_settings_keep_the_engine_s_defaults():
    assert Settings(model="m", concurrency=64).engine_config() == EngineConfig(
        scheduler=SchedulerConfig(max_pending=1024))


def test_the_settings_offer_the_engine_s_choices():
    assert get_args(Settings.model_fields["cache_dtype"].annotation) == get_args(CacheDtype)
    choices, none = get_args(Settings.model_fields["quantize"].annotation)
    assert get_args(choices) == get_args(Quantization) and none is type(None)


def worker_parser() -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["worker"]


def test_every_worker_setting_has_an_option_whose_help_names_its_variable():
    options = {action.dest: action for action in worker_parser()._actions}
    for name, info in Settings.model_fields.items():
        if name in CLIENT_ONLY:
            assert name not in options
            continue
        assert env_name(name, info) in (options[name].help or ""), name


def test_the_options_keep_their_names_and_meanings():
    args = build_parser().parse_args([
        "worker", "--model", "m", "--visibility-timeout", "60", "--shutdown-grace", "0.5", "--no-prefix-caching",
        "--ngram-draft", "--cache-dtype", "k8v4", "--quantize", "int4", "--page-size", "16", "--dtype", "bfloat16",
        "--concurrency", "4", "--prefix-route", "0,1", "--metrics-port", "9100"])
    assert (args.visibility_timeout_s, args.shutdown_grace_s, args.prefix_caching, args.ngram_draft) == (
        60, 0.5, False, True)
    assert (args.cache_dtype, args.quantize, args.page_size, args.dtype, args.concurrency) == (
        "k8v4", "int4", 16, "bfloat16", 4)
    assert (args.prefix_route, args.metrics_port, args.draft_model, args.cache_tokens) == ("0,1", 9100, None, None)


@pytest.mark.parametrize("argv", [["--ngram-draft", "--draft-model", "d"], ["--cache-dtype", "int3"],
                                  ["--quantize", "fp4"], ["--page-size", "x"]])
def test_the_options_refuse_what_the_settings_refuse(argv: list[str]):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", *argv])


def test_lora_is_a_repeatable_option_read_as_name_and_path(monkeypatch: pytest.MonkeyPatch):
    args = build_parser().parse_args(["worker", "--lora", "sql-bot=/a/b", "--lora", "chat=/c=d", "--max-loras", "2"])
    assert (args.lora, args.max_loras) == (["sql-bot=/a/b", "chat=/c=d"], 2)
    for name in ("GENQ_LORA", "GENQ_MAX_LORAS"):  # restored after the test (_apply_settings exports them)
        monkeypatch.setenv(name, "")
    _apply_settings(args, ["lora", "max_loras"])
    settings = Settings()
    assert (settings.lora_adapters, settings.max_loras) == ({"sql-bot": "/a/b", "chat": "/c=d"}, 2)
    assert Settings(lora=[]).lora_adapters == {} and Settings.model_fields["max_loras"].default == 8


@pytest.mark.parametrize(("lora", "problem"), [
    (["a=/x", "a=/y"], "adapter name(s) a given twice"),
    (["a b=/x"], "adapter name 'a b' must match"),
    (["a"], "'a' is not NAME=PATH"),
    (["a="], "'a=' is not NAME=PATH"),
])
def test_bad_lora_settings_are_refused_naming_the_entry(lora: list[str], problem: str):
    with pytest.raises(ValueError, match=re.escape(problem)):
        Settings(lora=lora)
