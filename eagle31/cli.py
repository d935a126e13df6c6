"""Command-line plumbing shared by the thin CLIs in train/, data_prep/ and scripts/.

`recipe_main`: the recipe CLIs (Hydra composition over recipes/) with one-line errors.
`parse_key_values`: `key=value` arguments for the small tools in scripts/ (a dataclass is the schema).
`wants_help`: `-h` / `--help` prints the CLI's docstring instead of parsing it as an argument.

Hydra would bring an output directory and logging setup that these one-shot tools do not
need. A dataclass gives the names, types and defaults. Unknown or repeated keys, bad
values and missing required keys are a one-line `ConfigError`.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, TypeVar

from eagle31.config import ConfigError
from eagle31.io import ForeignDirectoryError
from eagle31.recipe import choose

T = TypeVar("T")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def recipe_main(fn: Callable[[Any], None], recipes_dir: str | Path, argv: list[str], usage: str = "") -> int:
    """Compose the recipe named by `argv` (`recipe=<name> field=value ...`) and run `fn(cfg)`.

    Bad input — an unknown recipe or field, a bad value, a missing file — is one
    line on stderr and exit code 2. `--help` prints `usage` (the CLI's docstring),
    the recipes and the config sections; `--cfg` prints the composed config
    instead of running `fn`.
    """
    from eagle31.recipe import describe_recipes, load_recipe

    if wants_help(argv, f"{usage.rstrip()}\n\n{describe_recipes(recipes_dir)}"):
        return 0
    if "--cfg" in argv:
        fn, argv = _print_config, [a for a in argv if a != "--cfg"]

    try:
        fn(load_recipe(recipes_dir, argv))
    except (ConfigError, ForeignDirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


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
    missing = [n for n, f in fields.items() if n not in values and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required argument(s): {', '.join(f'{n}=...' for n in missing)}")
    return schema(**values)


def _convert(key: str, raw: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if raw.lower() in ("none", "null", ""):
            return None
        hint = next(a for a in args if a is not type(None))
    if hint is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(f"{key} must be true or false, got {raw!r}")
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return choose(hint, raw, key)
    if hint is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{key} must be an integer, got {raw!r}") from None
    return raw
