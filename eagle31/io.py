"""Atomic file writes and checksums, shared by every writer in the package.

A file is written under a temporary name in the same directory, flushed to
disk and renamed over the destination, so a reader never sees a partial file
and a killed writer leaves only a `*.tmp-*` file behind.

Output directories are owned: every directory the project writes carries a marker file
(`OUTPUT_MARKER`, naming what kind of output it is). A directory is only ever replaced or
written into when it is empty, missing, or carries our marker of the same kind, so a
user's folder (one holding their source data, say) is never deleted or mixed with ours.
A directory that cannot be created or written is refused before any work too.

`hold_lock` keeps a second process out of a directory for as long as the first runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle31.errors import FileAccessError, InputError, OutputInUseError


@contextmanager
def atomic_path(dest: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on success rename it to `dest`."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = _unique_sibling(dest)
    os.close(os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies, as to any file
    mode = stat.S_IMODE(tmp_path.stat().st_mode)
    try:
        yield tmp_path
        os.chmod(tmp_path, mode)  # a writer that recreates the file (safetensors does) made it 0600
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, dest)
        fsync_dir(dest.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


OUTPUT_MARKER = ".eagle31-output.json"


class ForeignDirectoryError(InputError):
    """An output directory exists, is not empty and is not an output of ours (of this kind)."""


def output_kind(path: str | Path) -> str | None:
    """The kind recorded in `path`'s marker, or None when `path` holds no marker of ours."""
    try:
        return json.loads((Path(path) / OUTPUT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def check_output_dir(path: str | Path, kind: str) -> None:
    """Refuse (one line) to write `kind` output into `path` unless it is missing, empty, ours of that kind,
    or holds nothing but outputs of ours (`data_prep/prepare.py` made `<output_dir>/data` before the run)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ForeignDirectoryError(f"{path} is not a directory; choose another output path")
    check_writable(path)
    if not path.exists() or all(_TEMPORARY.fullmatch(p.name) or output_kind(p) for p in path.iterdir()):
        return  # empty, or only our outputs and our writes in flight (ranks claiming one store together)
    found = output_kind(path)
    if found != kind:
        what = f"a {found} output of eagle31" if found else "files that eagle31 did not write"
        raise ForeignDirectoryError(
            f"{path} holds {what}; refusing to write a {kind} output there (choose an empty or new directory)"
        )


def check_writable(path: str | Path) -> None:
    """Refuse (one line) a directory `path`, maybe not there yet, that could not be created or written.

    A file in the way is a choice to change (`ForeignDirectoryError`, exit 2); no permission is `FileAccessError`.
    """
    path = Path(path).absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ForeignDirectoryError(f"cannot create {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write to" if existing == path else f"create {path} in"
        raise FileAccessError(f"cannot {what} {existing}: permission denied")


LOCK_FILE = ".eagle31-lock"


@contextmanager
def hold_lock(directory: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (which must exist) while the block runs.

    The lock is `flock` on `LOCK_FILE`, so the kernel releases it when the holder dies,
    even by SIGKILL: no stale lock to clean up. The file names the holder (pid, host,
    start time) for the one-line `OutputInUseError` a second process gets.
    """
    path = Path(directory) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            raise OutputInUseError(
                f"{directory} is in use by another run ({holder}); wait for it to end or choose another directory"
            ) from None
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def claim_output_dir(path: str | Path, kind: str) -> Path:
    """Create `path` (or reuse one of ours of the same kind) for in-place writing, and mark it as ours."""
    path = Path(path)
    check_output_dir(path, kind)
    path.mkdir(parents=True, exist_ok=True)
    if output_kind(path) != kind:
        atomic_write_json(path / OUTPUT_MARKER, {"kind": kind})
    return path


@contextmanager
def atomic_dir(dest: str | Path, kind: str) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `dest` (the old one moved aside, then removed).

    `dest` must be missing, empty, or an output of ours of the same `kind` (`check_output_dir`);
    the new directory carries the marker, so a later run may replace it again.
    """
    dest = Path(dest)
    check_output_dir(dest, kind)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(dest)
    tmp.mkdir(0o777)  # the umask applies (tempfile's 0o700 would hide exports from other users)
    try:
        atomic_write_json(tmp / OUTPUT_MARKER, {"kind": kind})
        yield tmp
        old = dest.with_name(f".{dest.name}.old-{tmp.name[-8:]}")
        if dest.exists():
            dest.rename(old)
        tmp.rename(dest)
        fsync_dir(dest.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unique_sibling(dest: Path) -> Path:
    """A fresh hidden name beside `dest` (`.name.tmp-<random>`, `_TEMPORARY`), unlikely to collide; O_EXCL / mkdir check it."""
    return dest.with_name(f".{dest.name}.tmp-{secrets.token_hex(4)}")


_TEMPORARY = re.compile(r"\..+\.tmp-[0-9a-f]{8}")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(dest: str | Path, text: str) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_text(text)


def atomic_write_json(dest: str | Path, obj: Any) -> None:
    atomic_write_text(dest, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save_safetensors(
    tensors: dict, dest: str | Path, save_file: Callable, metadata: dict[str, str] | None = None
) -> None:
    """`save_file` is `safetensors.torch.save_file` (passed in to keep this module torch-free)."""
    with atomic_path(dest) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
