"""Atomic file writes and checksums, shared by every writer in the package.

A file is written under a temporary name in the same directory, flushed to
disk and renamed over the destination, so a reader never sees a partial file
and a killed writer leaves only a `*.tmp-*` file behind.

Output directories are owned: every directory the project writes carries a marker file
(`OUTPUT_MARKER`, naming what it holds: its content, the marker's `kind` field). A directory is only ever replaced or
written into when it is empty, missing, or carries our marker of the same content (or, for a
run directory, holds nothing but that run's own parts), so a user's folder, a folder of
other runs or an output of another step is never deleted or mixed with ours
(`check_output_dir`, the one rule every step calls). A directory that cannot be created or
written is refused before any work too. `atomic_dir` replaces a directory by two renames;
a kill between them is repaired on the next start (`recover_swap`).

One module, though long: the atomic writes, the ownership marker, the directory swap and the run
lock lean on each other (a swap's writer holds flock on the new directory's marker; the lock file is
written as the atomic writes are), so splitting them would spread one set of invariants over files.

`hold_lock` keeps a second process out of a directory for as long as the first runs, with
`flock`, or with a lock file and a heartbeat where the filesystem has no `flock`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from eagle31.errors import DiskFullError, Eagle31Error, FileAccessError, InputError, OutputInUseError


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
    """An output directory exists, is not empty and is not an output of ours (with this content)."""


def output_content(path: str | Path) -> str | None:
    """The content recorded in `path`'s marker, or None when `path` holds no marker of ours."""
    try:
        return json.loads((Path(path) / OUTPUT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def check_output_dir(path: str | Path, content: str, parts: Mapping[str | Path, str] | None = None) -> None:
    """Refuse (one line, before any work) to write `content` output into `path` unless `path` is that step's own.

    The one ownership rule of every step (prepare, capture, regeneration, train, export, evaluation):
    `path` must be missing, empty, or carry our marker of `content`. `parts` names the outputs a run
    writes inside its own directory before it claims it (`{"<run>/data": "prepared-data", ...}`):
    a directory holding nothing but those, each with its content, counts as the run's own too. Anything
    else — a user's file, another run, an output with other content or in another place — is refused,
    and the message names what is there. A swap of `atomic_dir` that a kill interrupted is repaired
    first (`recover_swap`).
    """
    path = Path(path)
    recover_swap(path)
    if path.exists() and not path.is_dir():
        raise ForeignDirectoryError(f"{path} is not a directory; choose another output path")
    check_writable(path)
    if not path.exists() or output_content(path) == content:
        return
    found = output_content(path)
    if found is not None:
        raise ForeignDirectoryError(
            f"{path} holds a {found} output of eagle31; refusing to write a {content} output there (choose an empty or new directory)"
        )
    wanted = {os.path.abspath(p): k for p, k in (parts or {}).items()}
    foreign = _foreign_entries(path, wanted)
    if foreign:
        raise ForeignDirectoryError(
            f"{path} holds {_describe(foreign)}; refusing to write a {content} output there (choose an empty or new directory)"
        )


def _foreign_entries(directory: Path, parts: dict[str, str]) -> list[tuple[str | None, str]]:
    """(content or None, name) of each entry of `directory` that is neither one of `parts` nor a write of ours in flight."""
    found = []
    for entry in sorted(directory.iterdir()):
        if _TEMPORARY.fullmatch(entry.name) or _SWAPPED_OUT.fullmatch(entry.name):
            continue  # ranks claiming one store together; an atomic_dir swap
        where, content = os.path.abspath(entry), output_content(entry)
        if where in parts and content == parts[where]:
            continue
        holds_parts = any(p.startswith(where + os.sep) for p in parts)
        if (
            holds_parts and content is None and entry.is_dir()
        ):  # <run>/features holding the stores <run>/features/<split>
            found += [(k, f"{entry.name}/{name}") for k, name in _foreign_entries(entry, parts)]
            continue
        found.append((content, entry.name))
    return found


def _describe(entries: list[tuple[str | None, str]], shown: int = 5) -> str:
    """`2 run outputs of eagle31 (a, b) and files that eagle31 did not write (notes.txt)`."""
    by_kind: dict[str | None, list[str]] = {}
    for content, name in entries:
        by_kind.setdefault(content, []).append(name)
    said = []
    for content, names in sorted(by_kind.items(), key=lambda kv: (kv[0] is None, kv[0] or "")):
        listed = ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")
        what = "files that eagle31 did not write" if content is None else f"{len(names)} {content} output(s) of eagle31"
        said.append(f"{what} ({listed})")
    return " and ".join(said)


def recover_swap(dest: str | Path) -> None:
    """Finish what a kill during `atomic_dir`'s swap left beside `dest`, and say what was restored.

    Killed between its two renames (`dest` -> `.dest.old-*`, then `.dest.tmp-*` -> `dest`), the
    swap leaves no `dest`: the old output is renamed back (the new one was not in place yet).
    Killed after the second, it leaves the old output beside the new one: it is removed. Swaps
    that live processes are making (other runs writing a shared directory) are waited for, not
    undone: each writer holds `flock` on its new directory's marker between the two renames
    (`_swap_lock`), and nothing is restored or removed before every such swap of `dest` has ended
    (`_holding_swaps`; a filesystem without `flock` cannot tell the two apart). Of several old
    outputs, the one put back is the one whose swap was cut between its renames (its new directory
    still there), not an older one that a finished swap had yet to remove.
    """
    dest = Path(dest)
    if not dest.parent.is_dir() or not _old_outputs(dest):
        return
    with _holding_swaps(dest):
        leftovers = _old_outputs(dest)
        if leftovers and not dest.exists():
            old = leftovers.pop(0)
            new = _swap_new(dest, old)
            try:
                old.rename(dest)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    raise
                # another process restored it, or put its own output in place, first
            else:
                fsync_dir(dest.parent)
                leftovers.append(new)
                print(
                    f"warning: restored {dest} from {old.name}: a write replacing it was killed between its two renames",
                    file=sys.stderr,
                )
    for leftover in leftovers:  # of swaps that have ended: none of them is in flight
        shutil.rmtree(leftover, ignore_errors=True)


def _old_outputs(dest: Path) -> list[Path]:
    """The old outputs `atomic_dir` moved aside from `dest`: the one whose swap was cut between its renames first."""
    olds = [p for p in dest.parent.iterdir() if (m := _SWAPPED_OUT.fullmatch(p.name)) and m.group(1) == dest.name]
    return sorted(olds, key=lambda old: (not _swap_new(dest, old).is_dir(), old.name))


def _swap_new(dest: Path, old: Path) -> Path:
    """The new directory of the swap that moved `dest` aside as `old` (`atomic_dir` names both after one token)."""
    return dest.with_name(f".{dest.name}.tmp-{_SWAPPED_OUT.fullmatch(old.name).group(2)}")


SWAP_WAIT_S = 30.0  # the longest a step waits for another process's swap (two renames) to end


@contextmanager
def _swap_lock(new: Path) -> Iterator[None]:
    """Hold `flock` on the marker of `new` (an `atomic_dir` in flight) while the block swaps it into place."""
    fd = os.open(new / OUTPUT_MARKER, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                raise
        yield
    finally:
        os.close(fd)


@contextmanager
def _holding_swaps(dest: Path) -> Iterator[None]:
    """Once every swap of `dest` that a live process is making has ended, run the block with none starting.

    Each `atomic_dir` of `dest` in flight is a `.dest.tmp-*` directory whose writer takes `flock` on
    its marker for the two renames; this takes the same lock on each (`_take_swap_lock`).
    """
    prefix = f".{dest.name}.tmp-"
    with ExitStack() as held:
        for new in sorted(
            p for p in dest.parent.iterdir() if p.name.startswith(prefix) and _TEMPORARY.fullmatch(p.name)
        ):
            fd = _take_swap_lock(new, dest)
            if fd is not None:
                held.callback(os.close, fd)  # releases the lock
        yield


def _take_swap_lock(new: Path, dest: Path) -> int | None:
    """Take `new`'s swap lock once no live process holds it (its swap of `dest` is done, or it died); the open
    marker holding it, or None when `new` has no marker (not written yet: nothing in flight)."""
    try:
        fd = os.open(new / OUTPUT_MARKER, os.O_RDONLY)
    except OSError:
        return None
    deadline = time.monotonic() + SWAP_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise OutputInUseError(
                    f"{dest} is being replaced by another process, which has not finished in {SWAP_WAIT_S:g} s; "
                    "wait for it to end, then rerun"
                ) from None
            time.sleep(0.01)
        except OSError as e:
            if e.errno in _NO_FLOCK:
                return fd
            os.close(fd)
            raise


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
HELD_FILE = ".eagle31-lock.held"  # the lock where the filesystem has no `flock` (an NFS mount without locking)
HEARTBEAT_S = 30.0  # how often the holder of a HELD_FILE lock touches it
STALE_AFTER_S = 600.0  # a HELD_FILE untouched this long has lost its holder (a host gone, a clock far off)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)


@contextmanager
def hold_lock(directory: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `directory` (which must exist) while the block runs.

    The lock is `flock` on `LOCK_FILE`, so the kernel releases it when the holder dies,
    even by SIGKILL: no stale lock to clean up. The file names the holder (pid, host,
    start time) for the one-line `OutputInUseError` a second process gets.

    Where the filesystem has no `flock` (`ENOLCK`: NFS mounted without a lock manager),
    the lock is the file `HELD_FILE`, linked into place whole (so it never exists empty),
    naming the holder's host, pid, PID namespace and a random token, and touched every
    `HEARTBEAT_S` by a thread of the holder. A second process takes it over when it is stale:
    its pid is gone in the same PID namespace of this kernel (a pid of another container,
    even one sharing the host name, says nothing here), or it was not touched for
    `STALE_AFTER_S` (the holder's host died), and says so in one line (`_break_lock`).
    """
    directory = Path(directory)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if _flock(fd, directory):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{_holder()}\n".encode(), 0)
            yield
            return
    finally:
        os.close(fd)  # releases the lock
    with _hold_lock_file(directory):
        yield


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime())}"


def _flock(fd: int, directory: Path) -> bool:
    """Take `flock` on `fd`; False when the filesystem does not support it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        raise OutputInUseError(
            f"{directory} is in use by another run ({holder}); wait for it to end or choose another directory"
        ) from None
    except OSError as e:
        if e.errno in _NO_FLOCK:
            return False
        raise
    return True


@contextmanager
def _hold_lock_file(directory: Path) -> Iterator[None]:
    path = directory / HELD_FILE
    while True:
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_ns": _pid_namespace(),
            "token": secrets.token_hex(16),
            "holder": _holder(),
        }
        if _create_lock_file(path, me):
            break
        holder, why_stale, identity = _stale_holder(path)
        if why_stale is None:
            raise OutputInUseError(
                f"{directory} is in use by another run ({holder}; a lock file, as its filesystem has no flock); "
                f"wait for it to end or choose another directory"
            )
        if identity is not None and _break_lock(path, identity, holder):
            print(f"warning: {directory}: taking over the lock of {holder} ({why_stale})", file=sys.stderr)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(path, stop), name="eagle31-lock-heartbeat", daemon=True)
    beat.start()
    try:
        yield
    finally:
        stop.set()
        beat.join()
        if (_read_holder(path) or {}).get("token") == me["token"]:
            path.unlink(missing_ok=True)


def _create_lock_file(path: Path, record: dict) -> bool:
    """Put the lock file `record` at `path` unless one is there; False when one is.

    Written beside it and hard-linked into place: the link is atomic and exclusive on NFS
    too, and the lock file never exists without its holder's record.
    """
    tmp = _unique_sibling(path)
    try:
        with open(tmp, "x") as f:
            f.write(json.dumps(record))
            f.flush()
            os.fsync(f.fileno())
        try:
            _link(tmp, path)
        except FileExistsError:
            return os.stat(tmp).st_nlink == 2  # NFS: a link the client sent again may fail although the first one took
        fsync_dir(path.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _link(source: Path, name: Path) -> None:
    """`os.link`, and a filesystem with neither `flock` nor hard links one line (FileAccessError)."""
    try:
        os.link(source, name)
    except (FileExistsError, FileNotFoundError):
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise
        raise FileAccessError(
            f"{name.parent}: its filesystem has neither flock nor hard links, one of which the lock of a run needs "
            f"({e.strerror}); choose a directory on another filesystem"
        ) from None


def _pid_namespace() -> str | None:
    """This process's PID namespace as the kernel names it (boot id and namespace inode), or None off Linux.

    A pid means something only within its namespace: two containers sharing the host name
    (host networking) each number their processes from 1.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _read_holder(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
        return None


def _lock_identity(path: Path) -> tuple[tuple | None, dict | None]:
    """(the identity of the lock file at `path`: inode, mtime and token; its record) — (None, None) when none is there."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(65536)
    except FileNotFoundError:
        return None, None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    record = record if isinstance(record, dict) else None
    return (st.st_ino, st.st_mtime_ns, (record or {}).get("token")), record


def _stale_holder(path: Path) -> tuple[str, str | None, tuple | None]:
    """(who holds the lock file, why it is stale or None while it is live, the identity of the file judged)."""
    identity, holder = _lock_identity(path)
    if identity is None:
        return "a holder that just let go", "released", None
    age = time.time() - identity[1] / 1e9
    said = holder.get("holder", "unknown") if holder else "an unreadable lock file"
    namespace = _pid_namespace()
    if (
        holder
        and namespace is not None
        and holder.get("pid_ns") == namespace
        and not pid_alive(int(holder.get("pid", 0)))
    ):
        return said, f"pid {holder.get('pid')} is gone on this host", identity
    if age > STALE_AFTER_S:
        return said, f"its heartbeat is {age:.0f} s old", identity
    return said, None, identity


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    try:  # a zombie (dead, not yet reaped by its parent) still answers kill
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _break_lock(path: Path, identity: tuple, holder: str) -> bool:
    """Remove the stale lock file judged as `identity`, and nothing else; False when it is no longer there.

    Several processes may judge one lock file stale at once. Each links whatever is at `path`
    to a name derived from `identity`: only one can take that name, and it removes `path`
    only when the file it linked is the one judged (same inode, mtime and token). A lock
    file created since, or touched by a live holder since, is left alone; a process that finds
    the name taken is refused, as the one that took it holds the lock next. A claim left by a
    breaker that died in between is passed over once it is `STALE_AFTER_S` old.
    """
    name = hashlib.sha256(repr(identity).encode()).hexdigest()[:16]
    dead: list[Path] = []
    while True:
        claim = path.with_name(f"{path.name}.break-{name}-{len(dead)}")
        try:
            _link(path, claim)
            break
        except FileNotFoundError:
            return False  # released, or broken by another process
        except FileExistsError:
            try:
                age = time.time() - claim.stat().st_ctime  # the link set it
            except FileNotFoundError:
                return False  # its breaker was done: look again
            if age <= STALE_AFTER_S:
                raise OutputInUseError(
                    f"{path.parent} is being taken over by another run from {holder} (a lock file, as its filesystem has no flock); "
                    "wait for it to end or choose another directory"
                ) from None
            dead.append(claim)  # its breaker died before it was done
    try:
        if _lock_identity(claim)[0] != identity:
            return False  # not the file judged stale: a lock taken, or touched by its live holder, since
        path.unlink(missing_ok=True)  # only the process that linked `claim` gets here for this file
        fsync_dir(path.parent)
        for old in dead:
            old.unlink(missing_ok=True)
        return True
    finally:
        claim.unlink(missing_ok=True)


def _heartbeat(path: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            os.utime(path)
        except OSError:
            pass  # the next process will see the heartbeat stop and say so


def claim_output_dir(path: str | Path, content: str, parts: Mapping[str | Path, str] | None = None) -> Path:
    """Create `path` (or reuse one of ours of the same content) for in-place writing, and mark it as ours (`check_output_dir`)."""
    path = Path(path)
    check_output_dir(path, content, parts)
    path.mkdir(parents=True, exist_ok=True)
    if output_content(path) != content:
        atomic_write_json(path / OUTPUT_MARKER, {"kind": content})
    return path


@contextmanager
def atomic_dir(dest: str | Path, content: str) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces `dest` (the old one moved aside, then removed).

    `dest` must be missing, empty, or an output of ours of the same `content` (`check_output_dir`);
    the new directory carries the marker, so a later run may replace it again. A kill at any
    point leaves `dest` whole, old or new, or (between the two renames) the old one aside,
    which the next `check_output_dir` of `dest` puts back.
    """
    dest = Path(dest)
    check_output_dir(dest, content)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(dest)
    tmp.mkdir(0o777)  # the umask applies (tempfile's 0o700 would hide exports from other users)
    try:
        atomic_write_json(tmp / OUTPUT_MARKER, {"kind": content})
        yield tmp
        old = dest.with_name(f".{dest.name}.old-{tmp.name[-8:]}")
        with _swap_lock(tmp):  # another process's `recover_swap` waits for the two renames
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
_SWAPPED_OUT = re.compile(r"\.(.+)\.old-([0-9a-f]{8})")  # `atomic_dir`'s old directory, moved aside


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


@contextmanager
def write_errors(what: str, kept: str) -> Iterator[None]:
    """A write under the block that fails for lack of space or permission becomes one line naming `what` and `kept`.

    `DiskFullError` (exit 6) when the disk filled up, `FileAccessError` (exit 5) for permission
    denied or a read-only file system; `kept` says what a rerun will find (the writers under the
    block are atomic, so a partial file never remains under its real name).
    """
    try:
        yield
    except Eagle31Error:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise DiskFullError(
                f"the disk holding {what} filled up; {kept}; free space, then rerun the same command"
            ) from None
        denied = _os_error(e, (errno.EACCES, errno.EPERM, errno.EROFS))
        if denied is not None:
            where = f" ({denied.filename})" if denied.filename else ""
            raise FileAccessError(f"cannot write {what}: {denied.strerror}{where}; {kept}") from None
        raise


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from, is ENOSPC (some writers report it only as text: safetensors, DCP)."""
    return _os_error(e, (errno.ENOSPC,)) is not None or "No space left on device" in str(e)


def _os_error(e: BaseException, errnos: tuple[int, ...]) -> OSError | None:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in errnos:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


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
