"""Atomic files and directories, output ownership, the run lock, one-line write errors (docs/reliability.md)."""

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
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from eagle31.errors import DiskFullError, Eagle31Error, FileAccessError, InputError, OutputInUseError

OUTPUT_MARKER = ".eagle31-output.json"
SWAP_WAIT_S = 30.0  # the longest a step waits for another process's swap (two renames) to end
LOCK_FILE = ".eagle31-lock"
HELD_FILE = ".eagle31-lock.held"  # the lock where the filesystem has no `flock` (an NFS mount without locking)
HEARTBEAT_S = 30.0  # how often the holder of a HELD_FILE lock touches it
STALE_AFTER_S = 600.0  # a HELD_FILE untouched this long has lost its holder (a host gone, a clock far off)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
_NO_LINK = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)
_TEMPORARY = re.compile(r"\..+\.tmp-[0-9a-f]{8}")
_SWAPPED_OUT = re.compile(r"\.(.+)\.old-([0-9a-f]{8})")  # `atomic_dir`'s old directory, moved aside


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
        tmp_path.unlink(missing_ok=True)


class ForeignDirectoryError(InputError):
    """An output directory exists, is not empty and is not an output of ours (with this content)."""


def output_content(path: str | Path) -> str | None:
    """The content recorded in `path`'s marker, or None when `path` holds no marker of ours."""
    try:
        return json.loads((Path(path) / OUTPUT_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def check_output_dir(path: str | Path, content: str, parts: Mapping[str | Path, str] | None = None) -> None:
    """Refuse (naming what is there) to write `content` into `path` unless it is missing, empty, marked as `content`,
    or holds nothing but `parts` (`{"<run>/data": "prepared-data"}`: what a run writes before claiming it)."""
    path = Path(path)
    recover_swap(path)
    if path.exists() and not path.is_dir():
        raise ForeignDirectoryError(f"{path} is not a directory; choose another output path")
    check_writable(path)
    found = output_content(path) if path.exists() else content
    wanted = {os.path.abspath(p): k for p, k in (parts or {}).items()}
    foreign = _foreign_entries(path, wanted) if found is None else []
    if found != content and (found is not None or foreign):
        held = _describe(foreign) if found is None else f"a {found} output of eagle31"
        raise ForeignDirectoryError(
            f"{path} holds {held}; refusing to write a {content} output there (choose an empty or new directory)"
        )


def _foreign_entries(directory: Path, parts: dict[str, str]) -> list[tuple[str | None, str]]:
    """(content or None, name) of each entry of `directory` neither one of `parts` nor a write of ours in flight."""
    found = []
    for entry in sorted(directory.iterdir()):
        if _TEMPORARY.fullmatch(entry.name) or _SWAPPED_OUT.fullmatch(entry.name):
            continue  # ranks claiming one store together; an atomic_dir swap
        where, content = os.path.abspath(entry), output_content(entry)
        if where in parts and content == parts[where]:
            continue
        holds_parts = any(p.startswith(where + os.sep) for p in parts)  # <run>/features holding <run>/features/<split>
        if holds_parts and content is None and entry.is_dir():
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


def recover_swap(dest: Path) -> None:
    """When live swaps of `dest` end, restore a killed swap's old output (saying so); clear finished ones' leftovers."""
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
                why = "a write replacing it was killed between its two renames"
                print(f"warning: restored {dest} from {old.name}: {why}", file=sys.stderr)
    for leftover in leftovers:  # of swaps that have ended: none of them is in flight
        shutil.rmtree(leftover, ignore_errors=True)


def _old_outputs(dest: Path) -> list[Path]:
    """The old outputs `atomic_dir` moved aside from `dest`, first the one of a cut swap (its new one still there)."""
    olds = [p for p in dest.parent.iterdir() if (m := _SWAPPED_OUT.fullmatch(p.name)) and m.group(1) == dest.name]
    return sorted(olds, key=lambda old: (not _swap_new(dest, old).is_dir(), old.name))


def _swap_new(dest: Path, old: Path) -> Path:
    """The new directory of the swap that moved `dest` aside as `old` (`atomic_dir` names both after one token)."""
    return dest.with_name(f".{dest.name}.tmp-{old.name[-8:]}")


@contextmanager
def _holding_swaps(dest: Path) -> Iterator[None]:
    """Run the block once the swaps of `dest` live processes make have ended, with none starting (markers' flock)."""
    prefix = f".{dest.name}.tmp-"
    with ExitStack() as held:
        swaps = [p for p in dest.parent.iterdir() if p.name.startswith(prefix) and _TEMPORARY.fullmatch(p.name)]
        for new in sorted(swaps):
            try:
                fd = os.open(new / OUTPUT_MARKER, os.O_RDONLY)
            except OSError:
                continue  # no marker: nothing to wait for
            held.callback(os.close, fd)  # releases the lock
            deadline = time.monotonic() + SWAP_WAIT_S
            while True:
                try:
                    _flock(fd)  # without flock on the filesystem: no swap can be waited for
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OutputInUseError(
                            f"{dest} is being replaced by another process, which has not finished in "
                            f"{SWAP_WAIT_S:g} s; wait for it to end, then rerun"
                        ) from None
                    time.sleep(0.01)
        yield


def check_writable(path: str | Path) -> None:
    """Refuse a directory `path` (maybe not there yet) that cannot be created or written, in one line."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ForeignDirectoryError(f"cannot create {path}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write to" if existing == path else f"create {path} in"
        raise FileAccessError(f"cannot {what} {existing}: permission denied")


@contextmanager
def hold_lock(directory: str | Path) -> Iterator[None]:
    """Lock `directory` while the block runs (`OutputInUseError` for a second process): `flock`, or a heartbeat file."""
    directory = Path(directory)
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            locked = _flock(fd)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            raise OutputInUseError(
                f"{directory} is in use by another run ({holder}); wait for it to end or choose another directory"
            ) from None
        if locked:
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


def _flock(fd: int, flags: int = fcntl.LOCK_EX | fcntl.LOCK_NB) -> bool:
    """`flock(fd, flags)`; False where the filesystem has no flock (`BlockingIOError`: another process holds it)."""
    try:
        fcntl.flock(fd, flags)
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
        return False
    return True


@contextmanager
def _hold_lock_file(directory: Path) -> Iterator[None]:
    path = directory / HELD_FILE
    while True:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": _pid_namespace(),
              "token": secrets.token_hex(16), "holder": _holder()}  # fmt: skip
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
        if (_lock_identity(path)[1] or {}).get("token") == me["token"]:
            path.unlink(missing_ok=True)


def _create_lock_file(path: Path, record: dict) -> bool:
    """Hard-link the lock file `record` into place (atomic and exclusive on NFS too); False when one is there."""
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
    except OSError as e:
        if isinstance(e, (FileExistsError, FileNotFoundError)) or e.errno not in _NO_LINK:
            raise
        raise FileAccessError(
            f"{name.parent}: its filesystem has neither flock nor hard links, one of which the lock of a run needs "
            f"({e.strerror}); choose a directory on another filesystem"
        ) from None


def _pid_namespace() -> str | None:
    """This process's PID namespace (boot id, inode), within which alone a pid means something; None off Linux."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _lock_identity(path: Path) -> tuple[tuple | None, dict | None]:
    """(the lock file's identity: inode, mtime and token; its record), or (None, None) when none is there."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(65536)
    except FileNotFoundError:
        return None, None
    with suppress(ValueError):
        if isinstance(record := json.loads(raw), dict):
            return (st.st_ino, st.st_mtime_ns, record.get("token")), record
    return (st.st_ino, st.st_mtime_ns, None), None


def _stale_holder(path: Path) -> tuple[str, str | None, tuple | None]:
    """(who holds the lock file, why it is stale or None while it is live, the identity of the file judged)."""
    identity, holder = _lock_identity(path)
    if identity is None:
        return "a holder that just let go", "released", None
    age = time.time() - identity[1] / 1e9
    said = holder.get("holder", "unknown") if holder else "an unreadable lock file"
    namespace = _pid_namespace()
    if holder and namespace and holder.get("pid_ns") == namespace and not pid_alive(int(holder.get("pid", 0))):
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
    """Remove the stale lock file judged as `identity` and nothing else (docs/reliability.md); False if it is gone."""
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
                    f"{path.parent} is being taken over by another run from {holder} (a lock file, as its filesystem "
                    "has no flock); wait for it to end or choose another directory"
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
        with suppress(OSError):  # the next process will see the heartbeat stop and say so
            os.utime(path)


def claim_output_dir(path: str | Path, content: str, parts: Mapping[str | Path, str] | None = None) -> Path:
    """Create `path` (or reuse ours of the same content) for writing in place, marked as ours (`check_output_dir`)."""
    path = Path(path)
    check_output_dir(path, content, parts)
    path.mkdir(parents=True, exist_ok=True)
    if output_content(path) != content:
        atomic_write_json(path / OUTPUT_MARKER, {"kind": content})
    return path


@contextmanager
def atomic_dir(dest: str | Path, content: str) -> Iterator[Path]:
    """Yield a marked temporary sibling directory that replaces `dest` on success by two renames (`recover_swap`)."""
    dest = Path(dest)
    check_output_dir(dest, content)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(dest)
    tmp.mkdir(0o777)  # the umask applies (tempfile's 0o700 would hide exports from other users)
    try:
        atomic_write_json(tmp / OUTPUT_MARKER, {"kind": content})
        yield tmp
        old = dest.with_name(f".{dest.name}.old-{tmp.name[-8:]}")
        with open(tmp / OUTPUT_MARKER, "rb") as marker:  # flocked till closed: `recover_swap` waits for the renames
            _flock(marker.fileno(), fcntl.LOCK_EX)
            if dest.exists():
                dest.rename(old)
            tmp.rename(dest)
        fsync_dir(dest.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _unique_sibling(dest: Path) -> Path:
    """A fresh hidden name beside `dest` (`.name.tmp-<random>`, `_TEMPORARY`); O_EXCL / mkdir check it."""
    return dest.with_name(f".{dest.name}.tmp-{secrets.token_hex(4)}")


def fsync_dir(path: Path) -> None:
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def write_errors(what: str, kept: str) -> Iterator[None]:
    """A write failing under the block for lack of space (exit 6) or permission (5): one line naming `what`, `kept`."""
    try:
        yield
    except Eagle31Error:
        raise
    except Exception as e:
        if is_disk_full(e):
            raise DiskFullError(
                f"the disk holding {what} filled up; {kept}; free space, then rerun the same command"
            ) from None
        if (denied := _os_error(e, (errno.EACCES, errno.EPERM, errno.EROFS))) is not None:
            where = f" ({denied.filename})" if denied.filename else ""
            raise FileAccessError(f"cannot write {what}: {denied.strerror}{where}; {kept}") from None
        raise


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from, is ENOSPC (safetensors and DCP may say it only as text)."""
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
    atomic_write_text(dest, json.dumps(obj, indent=2) + "\n")


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
