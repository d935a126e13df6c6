"""Build-once cache of the locally built targets: `$EAGLE31_CACHE/targets/<name>-<key>/` (docs/demo_target.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from eagle31.io import atomic_dir


def cache_dir() -> Path:
    """`$EAGLE31_CACHE`, default `~/.cache/eagle31`."""
    return Path(os.environ.get("EAGLE31_CACHE") or Path.home() / ".cache" / "eagle31")


def portable_path(path: str | Path) -> str:
    """`path` as results record it: `$EAGLE31_CACHE/...` in the cache, relative below the cwd, else as given."""
    p, cache, here = Path(path).absolute(), cache_dir().absolute(), Path.cwd()
    if p.is_relative_to(cache):
        return f"$EAGLE31_CACHE/{p.relative_to(cache)}"
    if p.is_relative_to(here):
        return str(p.relative_to(here))
    return str(path)


def ensure_built(name: str, key: str, build: Callable[[Path], object]) -> Path:
    """The directory of target `name`-`key`, calling `build(tmp_dir)` first if it does not exist."""
    root = cache_dir() / "targets"
    dest = root / f"{name}-{key}"
    if dest.is_dir():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{name}-{key}.lock")):
        if not dest.is_dir():  # else built by another process while we waited
            build_atomically(dest, build)
    return dest


def build_atomically(dest: str | Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp_dir)` in a fresh directory beside `dest`, then rename it to `dest` (which must not exist)."""
    dest = Path(dest)
    if dest.exists():
        raise FileExistsError(f"{dest} already exists; remove it first")
    with atomic_dir(dest, content="target") as tmp:
        build(tmp)
    return dest
