"""The command lines' shared plumbing, beside the library (which has no command line): recipes (`recipe_main`),
`key=value` arguments with a dataclass as schema (one-shot tools need no Hydra), `--help`, and each expected failure
as one line and its exit code (`run_cli`, docs/reliability.md)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sys
import types
import typing
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from eagle31.errors import (
    ConfigError,
    DiskFullError,
    Eagle31Error,
    FileAccessError,
    RunInterrupted,
    choose,
    report_to_launcher,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
_PROGRESS = "eagle31-progress"


def recipe_main(fn: Callable[[Any], None], recipes_dir: str | Path, argv: list[str], usage: str = "") -> int:
    """Compose the recipe of `argv` and run `fn(cfg)`; `--help` prints `usage` and the recipes, `--cfg` the config."""
    from eagle31.recipe import describe_recipes, describe_section

    if {"-h", "--help"} & set(argv):  # --help SECTION: that section's fields
        if sections := [a for a in argv if a not in ("-h", "--help") and "=" not in a]:
            return run_cli(lambda: print("\n\n".join(describe_section(s) for s in sections)))
    if wants_help(argv, f"{usage.rstrip()}\n\n{describe_recipes(recipes_dir)}"):
        return 0
    if "--cfg" in argv:
        fn, argv = _print_config, [a for a in argv if a != "--cfg"]
    show_progress_lines()

    def compose_and_run() -> None:
        from eagle31.recipe import load_recipe

        try:
            cfg = load_recipe(recipes_dir, argv)
        except ConfigError as e:
            hint = quoting_hint(argv) if "override_grammar" in str(e) else ""  # Hydra could not parse an override
            raise ConfigError(f"{e}{hint}") from None
        fn(cfg)

    return run_cli(compose_and_run)


def run_cli(body: Callable[[], Any]) -> int:
    """Run `body()`; return 0, or print the failure as one line and return its exit code."""
    try:
        body()
    except BaseException as e:  # noqa: BLE001 - every expected kind is mapped, the rest re-raised
        failure = as_expected_failure(e)
        if failure is None:
            raise
        message = "error: " + " ".join(str(failure).splitlines())  # one line, whatever the message
        print(message, file=sys.stderr)
        report_to_launcher(message)
        return failure.exit_code
    return 0


def show_progress_lines() -> None:
    """eagle31's INFO log lines on stderr, bare: the progress of one-time builds (the demo target)."""
    logger = logging.getLogger("eagle31")
    if not any(h.get_name() == _PROGRESS for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.set_name(_PROGRESS)
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def as_expected_failure(e: BaseException) -> Eagle31Error | None:
    """The `Eagle31Error` that `e` stands for, or None for a failure nobody expected (a bug)."""
    if isinstance(e, Eagle31Error):
        return e
    if isinstance(e, KeyboardInterrupt):
        return RunInterrupted("interrupted (Ctrl-C)")
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        if e.errno == errno.ENOSPC:
            return DiskFullError(f"{where}no space left on device; free some and run the command again")
        return FileAccessError(f"{where}{e.strerror or e}")
    return None


def quoting_hint(argv: list[str]) -> str:
    """For overrides whose value holds parentheses or spaces: how to quote them for Hydra."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not any(c in value for c in "() "):
            continue
        if value.startswith("[") and value.endswith("]"):
            items = ",".join(f'"{v.strip()}"' for v in value[1:-1].split(","))
            quoted = f"{key}=[{items}]"
        else:
            quoted = f'{key}="{value}"'
        return f" (a value with spaces or parentheses needs quotes inside the override: '{quoted}')"
    return ""


def wants_help(argv: list[str], usage: str) -> bool:
    """True, after printing `usage`, when the arguments ask for help."""
    if not {"-h", "--help"} & set(argv):
        return False
    print(usage.strip())
    return True


def _print_config(cfg: Any) -> None:
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(cfg), end="")


def parse_key_values(argv: list[str], schema: type[T]) -> T:
    """`["out=d", "dry_run=true"]` -> `schema(out="d", dry_run=True)`; fields without defaults are required."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    values: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep:
            raise ConfigError(f"arguments are key=value, got {arg!r}")
        if key not in fields:
            raise ConfigError(f"unknown argument {key!r}; valid: {', '.join(fields)}")
        if key in values:
            raise ConfigError(f"argument {key!r} given twice")
        values[key] = _convert(key, raw, hints[key])
    if missing := [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING]:
        raise ConfigError(f"missing required argument(s): {', '.join(f'{n}=...' for n in missing)}")
    return schema(**values)


def parse_keys_then_overrides(argv: list[str], schema: type[T], smoke: dict[str, Any]) -> tuple[T, list[str]]:
    """`[key=value ..., "--", overrides ...]` -> (`schema` of the keys, overrides); `--smoke` or SMOKE=1: `smoke`."""
    keys, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    cfg = parse_key_values([k for k in keys if k != "--smoke"], schema)
    if "--smoke" in keys or os.environ.get("SMOKE") == "1":
        cfg = dataclasses.replace(cfg, **smoke)
    return cfg, overrides


def _convert(key: str, raw: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        if raw.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"{key} must be true or false, got {raw!r}")
        return raw.lower() in _TRUE
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return choose(hint, raw, key)
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    return raw
