"""`genq worker`'s options, generated from the Settings fields (worker/settings.py),
so a setting, its GENQ_* variable and its option can never drift apart.

Each field becomes --kebab-name (dest: the field name; FLAG_NAMES keeps the
older names of two), typed from its annotation: a Literal gives the choices, a list a
repeatable option (--lora A=DIR --lora B=DIR), a
bool a switch that sets the non-default value (--ngram-draft, or
--no-prefix-caching for a setting that is on by default). The help is the
field's description, its GENQ_* variable and its default. Torch-free: the
producer commands share this parser.
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

FLAG_NAMES = {"visibility_timeout_s": "visibility-timeout", "shutdown_grace_s": "shutdown-grace"}
"""Options older than this generator whose names drop the field's _s (seconds) suffix."""
CLIENT_ONLY = frozenset({"watchdog_after_s", "prefix_route_chars"})
"""Shared settings only producers read: no worker option."""
EXCLUSIVE = (("ngram_draft", "draft_model"),)
"""Settings of which one option at most may be given (Settings also refuses both)."""


def add_settings_options(parser: argparse.ArgumentParser, settings: type[BaseSettings]) -> list[str]:
    """Add an option per setting; returns the field names, the dests the options set."""
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for names in EXCLUSIVE:
        group = parser.add_mutually_exclusive_group()
        groups.update(dict.fromkeys(names, group))
    added = []
    for name, info in settings.model_fields.items():
        if name in CLIENT_ONLY:
            continue
        target: Any = groups.get(name, parser)
        flag, options = _option(name, info)
        target.add_argument(flag, dest=name, **options)
        added.append(name)
    return added


def env_name(name: str, info: FieldInfo) -> str:
    """The GENQ_* variable that sets a field."""
    return info.validation_alias if isinstance(info.validation_alias, str) else f"GENQ_{name.upper()}"


def _option(name: str, info: FieldInfo) -> tuple[str, dict[str, Any]]:
    flag = FLAG_NAMES.get(name, name.replace("_", "-"))
    kind = _unwrap_optional(info.annotation)
    default = info.get_default(call_default_factory=True)
    help_text = f"{info.description or name} ({env_name(name, info)}"
    if kind is bool and default is True:
        help_text = f"switch {name.replace('_', ' ')} off; it does this: {help_text}; on by default)"
        return f"--no-{flag}", {"action": "store_const", "const": False, "help": help_text}
    if kind is bool:
        return f"--{flag}", {"action": "store_const", "const": True, "help": help_text + "; off by default)"}
    if default is not None:
        help_text += f"; default {default}"
    options: dict[str, Any] = {"help": help_text + ")"}
    if get_origin(kind) is list:
        options["action"] = "append"
        options["help"] = options["help"].replace("; default []", "")
    elif get_origin(kind) is Literal:
        options["choices"] = list(get_args(kind))
    elif kind in (int, float):
        options["type"] = kind
    return f"--{flag}", options


def _unwrap_optional(annotation: Any) -> Any:
    """X for X | None; the annotation itself otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        rest = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation
