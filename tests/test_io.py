"""Atomic writes: all or nothing, no leftovers, ordinary permissions; checksums."""

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle31.io import (
    OUTPUT_MARKER,
    ForeignDirectoryError,
    atomic_dir,
    atomic_path,
    atomic_save_safetensors,
    atomic_write_json,
    atomic_write_text,
    claim_output_dir,
    sha256_file,
)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    dest = tmp_path / "a.json"
    atomic_write_json(dest, {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(dest) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert dest.read_text() == '{\n  "v": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_a_failed_directory_leaves_the_old_one(tmp_path):
    dest = tmp_path / "d"
    with atomic_dir(dest, content="k") as tmp:
        (tmp / "x").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dest, content="k") as tmp:
        (tmp / "x").write_text("new")
        raise RuntimeError("killed")
    assert (dest / "x").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["d"]
    with atomic_dir(dest, content="k") as tmp:  # success replaces it whole
        (tmp / "y").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == [OUTPUT_MARKER, "y"] and [p.name for p in tmp_path.iterdir()] == [
        "d"
    ]


def test_a_directory_of_the_user_is_never_replaced_or_written_into(tmp_path):
    user = tmp_path / "project"
    user.mkdir()
    (user / "chats.jsonl").write_text("{}")
    with pytest.raises(ForeignDirectoryError, match="did not write"), atomic_dir(user, content="prepared-data"):
        pass
    with pytest.raises(ForeignDirectoryError, match="did not write"):
        claim_output_dir(user, "run")
    assert [p.name for p in user.iterdir()] == ["chats.jsonl"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ForeignDirectoryError, match="not a directory"):
        claim_output_dir(tmp_path / "file", "run")


def test_an_output_of_another_kind_is_refused_and_ours_is_reused(tmp_path):
    with atomic_dir(tmp_path / "d", content="prepared-data") as tmp:
        (tmp / "x").write_text("1")
    with (
        pytest.raises(ForeignDirectoryError, match="a prepared-data output"),
        atomic_dir(tmp_path / "d", content="export"),
    ):
        pass
    run = claim_output_dir(tmp_path / "run", "run")
    (run / "metrics.jsonl").write_text("")
    assert claim_output_dir(run, "run") == run and (run / "metrics.jsonl").exists()
    with atomic_dir(tmp_path / "d", content="prepared-data") as tmp:  # ours of this kind: replaced
        (tmp / "y").write_text("2")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [OUTPUT_MARKER, "y"]


def test_written_files_and_directories_follow_the_umask(tmp_path, umask_022):
    """Exports and checkpoints must be readable by other users (a vLLM server under another account)."""
    atomic_write_text(tmp_path / "f.txt", "x")
    atomic_save_safetensors({"w": torch.zeros(2)}, tmp_path / "m.safetensors", save_file)  # it recreates the file
    with atomic_dir(tmp_path / "d", content="k") as tmp:
        (tmp / "g").write_text("y")
    assert (
        mode(tmp_path / "f.txt") == 0o644
        and mode(tmp_path / "m.safetensors") == 0o644
        and mode(tmp_path / "d") == 0o755
    )


def test_sha256_reads_in_chunks(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "b").write_bytes(data)
    assert sha256_file(tmp_path / "b", chunk=4096) == hashlib.sha256(data).hexdigest()


def test_an_unwritable_output_parent_is_refused_before_any_work():
    """The kernel refuses a write into the parent, and `check_output_dir` says so in one line. Root may write
    anywhere, so under root (as CI runs) the check runs in a child that drops to an unprivileged user first."""
    import subprocess
    import sys
    import tempfile

    # not tmp_path: under root its parents are root's alone, and the unprivileged user could not even reach it
    with tempfile.TemporaryDirectory(dir="/tmp") as base:
        os.chmod(base, 0o755)
        locked = Path(base) / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        code = (
            "import os\n"
            "from pathlib import Path\n"
            "from eagle31.errors import FileAccessError\n"
            "from eagle31.io import check_output_dir\n"
            "if os.geteuid() == 0:\n"
            "    try:\n"
            "        os.setgroups([]); os.setgid(65534); os.setuid(65534)  # nobody: the kernel's permissions apply\n"
            "    except OSError as e:  # a user namespace without that uid\n"
            "        print(f'cannot drop root here ({e})'); raise SystemExit(0)\n"
            f"locked = Path({str(locked)!r})\n"
            "assert os.access(locked, os.R_OK | os.X_OK), 'the unprivileged user cannot even reach the directory'\n"
            "try:\n"
            "    (locked / 'probe').touch()\n"
            "    print('the kernel let this user write')\n"
            "except PermissionError:\n"
            "    try:\n"
            "        check_output_dir(locked / 'run', 'run')\n"
            "        print('accepted')\n"
            "    except FileAccessError as e:\n"
            "        print(e)\n"
        )
        try:
            child = subprocess.run(
                [sys.executable, "-c", code],
                cwd=Path(__file__).resolve().parents[1],
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            locked.chmod(0o755)
    assert child.returncode == 0, child.stderr
    if child.stdout.startswith("cannot drop root here"):
        pytest.skip(child.stdout.strip())
    assert child.stdout.strip() == f"cannot create {locked / 'run'} in {locked}: permission denied"


def test_a_directory_holding_only_our_writes_in_flight_counts_as_empty(tmp_path):
    """Several ranks claim one store at once: one's marker, still under its temporary name, must not stop another."""
    from eagle31.io import _unique_sibling, check_output_dir

    store = tmp_path / "store"
    store.mkdir()
    _unique_sibling(store / OUTPUT_MARKER).write_text("{}")
    check_output_dir(store, "feature-store")
    (store / "results.csv").write_text("a,b\n")
    with pytest.raises(ForeignDirectoryError):
        check_output_dir(store, "feature-store")


def test_a_run_directory_holding_only_its_own_parts_may_be_claimed(tmp_path):
    """`data_prep/prepare.py` writes `<output_dir>/data` (and capture `<output_dir>/features/<split>`) before the run
    claims it."""
    run = tmp_path / "run"
    with atomic_dir(run / "data", content="prepared-data") as tmp:
        (tmp / "report.json").write_text("{}")
    claim_output_dir(run / "features" / "train", "feature-store")
    parts = {run / "data": "prepared-data", run / "features" / "train": "feature-store"}
    assert claim_output_dir(run, "run", parts) == run
    other = tmp_path / "other"
    (other / "stuff").mkdir(parents=True)  # a folder of the user's beside the run's own part
    with atomic_dir(other / "data", content="prepared-data") as tmp:
        pass
    with pytest.raises(ForeignDirectoryError, match=r"files that eagle31 did not write \(stuff\)"):
        claim_output_dir(other, "run", {other / "data": "prepared-data"})
    with pytest.raises(ForeignDirectoryError, match=r"1 prepared-data output\(s\) of eagle31 \(data\)"):
        claim_output_dir(tmp_path / "other", "run")  # not one of this run's parts: another run's data, say


def test_a_folder_of_runs_is_never_replaced_by_another_step(tmp_path):
    """`data.prepared_dir=runs`: every run under it stays; the refusal names what is there."""
    runs = tmp_path / "runs"
    for name in ("a", "b"):
        (claim_output_dir(runs / name, "run") / "metrics.jsonl").write_text("{}\n")
    with atomic_dir(runs / "prepared", content="prepared-data") as tmp:
        (tmp / "report.json").write_text("{}")
    before = sorted(str(p.relative_to(runs)) for p in runs.rglob("*"))
    for step in (
        lambda: atomic_dir(runs, content="prepared-data").__enter__(),
        lambda: claim_output_dir(runs, "feature-store"),
    ):
        with pytest.raises(ForeignDirectoryError) as refused:
            step()
        assert str(refused.value).startswith(
            f"{runs} holds 1 prepared-data output(s) of eagle31 (prepared) and 2 run output(s) of eagle31 (a, b)"
        )
    assert sorted(str(p.relative_to(runs)) for p in runs.rglob("*")) == before


KILL_AT_RENAME = """
import os, signal, sys, types
from pathlib import Path
package = types.ModuleType("eagle31")  # eagle31.io alone: the package would import torch
package.__path__ = [os.path.join(sys.argv[1], "eagle31")]
sys.modules["eagle31"] = package
from eagle31.io import atomic_dir
real_rename = Path.rename
def rename(self, target):  # SIGKILL right after the swap's rename number sys.argv[3]
    moved = real_rename(self, target)
    rename.count += 1
    if rename.count == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return moved
rename.count = 0
Path.rename = rename
with atomic_dir(sys.argv[2], content="prepared-data") as tmp:
    (tmp / "x").write_text("new")
"""


@pytest.mark.parametrize("killed_after", [1, 2], ids=["between-the-renames", "after-both"])
def test_a_kill_during_the_swap_of_a_directory_is_repaired_on_the_next_start(tmp_path, killed_after, capfd):
    import subprocess
    import sys
    from pathlib import Path

    from eagle31.io import check_output_dir

    dest = tmp_path / "prepared"
    with atomic_dir(dest, content="prepared-data") as tmp:
        (tmp / "x").write_text("old")
    repo = Path(__file__).resolve().parents[1]
    killed = subprocess.run([sys.executable, "-c", KILL_AT_RENAME, str(repo), str(dest), str(killed_after)], timeout=60)
    assert killed.returncode == -9
    if killed_after == 1:
        assert not dest.exists()  # what the kill left: the old directory aside, the new one not in place
    check_output_dir(dest, "prepared-data")  # the next start of any step writing there
    expected = {1: "old", 2: "new"}[killed_after]
    assert (dest / "x").read_text() == expected and [p.name for p in tmp_path.iterdir()] == ["prepared"]
    said = capfd.readouterr().err
    assert ("restored" in said and str(dest) in said) == (killed_after == 1), said


def test_a_swap_in_progress_in_another_process_is_waited_for_not_undone(tmp_path, monkeypatch, capfd):
    """One process replaces a shared directory (two runs sharing a `data.prepared_dir`, or the target cache) and is
    between its two renames when another process's step starts writing there: the second waits for the swap, it
    does not take the first one's old directory, put aside, for one a kill left behind and undo the swap."""
    import threading

    from eagle31.io import check_output_dir

    dest = tmp_path / "prepared"
    with atomic_dir(dest, content="prepared-data") as tmp:
        (tmp / "x").write_text("old")
    between, checked = threading.Event(), threading.Event()
    real_rename = Path.rename

    def rename(self, target):
        moved = real_rename(self, target)
        if (
            threading.current_thread().name == "writer" and self == dest
        ):  # the old one is aside, the new one not in place
            between.set()
            checked.wait(1.0)  # the other step's check, unless it waits for this swap
        return moved

    monkeypatch.setattr(Path, "rename", rename)
    failed: list[BaseException] = []

    def write():
        try:
            with atomic_dir(dest, content="prepared-data") as tmp:
                (tmp / "x").write_text("new")
        except BaseException as e:
            failed.append(e)

    writer = threading.Thread(target=write, name="writer")
    writer.start()
    assert between.wait(10)
    check_output_dir(dest, "prepared-data")  # the other process's step, starting
    checked.set()
    writer.join(10)
    assert not failed, failed
    assert (dest / "x").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["prepared"]
    assert "restored" not in capfd.readouterr().err


def test_a_finished_swaps_old_output_is_not_put_back_over_another_swap_in_progress(tmp_path, monkeypatch, capfd):
    """Three processes share one output directory. A's swap has done both renames, its old output still beside
    the directory (A slow to remove it); B is between its two renames (the directory missing); C starts writing
    there. C waits for B's swap before it puts anything back, so it does not take A's old output for one a kill
    left behind: B's output stands, and A's is not lost on the way."""
    import shutil
    import threading

    import eagle31.io
    from eagle31.io import check_output_dir

    dest = tmp_path / "prepared"
    with atomic_dir(dest, content="prepared-data") as tmp:
        (tmp / "x").write_text("before A")
    real_sibling, real_rename, real_rmtree = eagle31.io._unique_sibling, Path.rename, shutil.rmtree
    names = {"A": "00000000", "B": "ffffffff"}  # A's old output is the first that C finds

    def sibling(path):
        return (
            path.with_name(f".{path.name}.tmp-{names[threading.current_thread().name]}")
            if path == dest
            else real_sibling(path)
        )

    b_written, a_swapped, b_between, c_checked, a_cleans = (threading.Event() for _ in range(5))

    def rmtree(path, *args, **kwargs):
        if threading.current_thread().name == "A" and Path(path).name == ".prepared.old-00000000":
            a_swapped.set()  # both of A's renames done; its old output is still there
            a_cleans.wait(10)
        return real_rmtree(path, *args, **kwargs)

    def rename(self, target):
        moved = real_rename(self, target)
        if threading.current_thread().name == "B" and self == dest:  # B's old output aside, its new one not in place
            b_between.set()
            c_checked.wait(1.0)  # C's check, unless it waits for this swap
        return moved

    monkeypatch.setattr(eagle31.io, "_unique_sibling", sibling)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    monkeypatch.setattr(Path, "rename", rename)
    failed: list[BaseException] = []

    def write(after: threading.Event | None = None):
        try:
            with atomic_dir(dest, content="prepared-data") as tmp:
                (tmp / "x").write_text(threading.current_thread().name)
                if after is not None:
                    b_written.set()
                    after.wait(10)  # A's swap ends while B writes
        except BaseException as e:
            failed.append(e)

    b = threading.Thread(target=write, args=(a_swapped,), name="B")
    a = threading.Thread(target=write, name="A")
    b.start()
    assert b_written.wait(10)
    a.start()
    assert b_between.wait(10)
    check_output_dir(dest, "prepared-data")  # C, starting
    c_checked.set()
    b.join(10)
    a_cleans.set()
    a.join(10)
    assert not failed, failed
    assert (dest / "x").read_text() == "B" and [p.name for p in tmp_path.iterdir()] == ["prepared"]
    assert "restored" not in capfd.readouterr().err


def test_of_two_old_outputs_the_one_whose_swap_a_kill_cut_is_put_back(tmp_path, capfd):
    """A's swap finished but left its old output beside the directory; B was then killed between its renames,
    its old output (A's) aside and its new one not in place. The next step puts A's output back, not the one
    from before A, whatever order their names sort in."""
    from eagle31.io import check_output_dir

    dest = tmp_path / "prepared"
    for name, x in (
        (".prepared.old-00000000", "before A"),
        (".prepared.old-ffffffff", "A"),
        (".prepared.tmp-ffffffff", "B"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / OUTPUT_MARKER).write_text(json.dumps({"kind": "prepared-data"}))
        (tmp_path / name / "x").write_text(x)
    check_output_dir(dest, "prepared-data")
    assert (dest / "x").read_text() == "A" and [p.name for p in tmp_path.iterdir()] == ["prepared"]
    assert "restored" in capfd.readouterr().err


# ---------------------------------------------------------------------------- locks without flock


@pytest.fixture
def no_flock(monkeypatch):
    """A filesystem without flock (NFS without a lock manager): every flock fails with ENOLCK."""
    import errno

    import eagle31.io

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(eagle31.io.fcntl, "flock", flock)


def test_without_flock_a_lock_file_keeps_a_second_run_out_and_goes_with_its_holder(tmp_path, no_flock):
    import socket

    from eagle31.errors import OutputInUseError
    from eagle31.io import HELD_FILE, hold_lock

    with hold_lock(tmp_path):
        held = json.loads((tmp_path / HELD_FILE).read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
        with (
            pytest.raises(OutputInUseError, match=f"pid {os.getpid()} on {socket.gethostname()}.*has no flock"),
            hold_lock(tmp_path),
        ):
            pass
    assert not (tmp_path / HELD_FILE).exists()
    with hold_lock(tmp_path):
        pass


def test_without_flock_a_lock_file_of_another_host_is_taken_over_once_its_heartbeat_stops(tmp_path, no_flock, capsys):
    import time

    from eagle31.errors import OutputInUseError
    from eagle31.io import HELD_FILE, STALE_AFTER_S, hold_lock

    held = tmp_path / HELD_FILE
    held.write_text(json.dumps({"host": "another-node", "pid": 1, "holder": "pid 1 on another-node"}))
    with pytest.raises(OutputInUseError, match="pid 1 on another-node"), hold_lock(tmp_path):
        pass  # its heartbeat is fresh: that host's run is alive
    old = time.time() - STALE_AFTER_S - 60
    os.utime(held, (old, old))  # that host died: no heartbeat since
    with hold_lock(tmp_path):
        pass
    assert "taking over the lock of pid 1 on another-node (its heartbeat is" in capsys.readouterr().err
    assert not held.exists() and os.listdir(tmp_path) == [".eagle31-lock"]  # no claim or temporary left behind


def test_the_holder_of_a_lock_file_keeps_its_heartbeat(tmp_path, no_flock, monkeypatch):
    import time

    import eagle31.io
    from eagle31.io import HELD_FILE, hold_lock

    monkeypatch.setattr(eagle31.io, "HEARTBEAT_S", 0.05)
    with hold_lock(tmp_path):
        old = time.time() - 3600
        os.utime(tmp_path / HELD_FILE, (old, old))
        deadline = time.time() + 10
        while (tmp_path / HELD_FILE).stat().st_mtime < old + 1:
            assert time.time() < deadline, "no heartbeat"
            time.sleep(0.02)


@pytest.mark.parametrize("where, holder", [("claimed", "first"), ("removed", "second"), ("created", "first")])
def test_two_breakers_of_one_stale_lock_file_never_both_hold_the_lock(tmp_path, no_flock, monkeypatch, where, holder):
    """Two processes judge the same stale lock file (an unreadable one); the first goes on to break it and stops
    `where` it is (its claim linked, the stale file not yet removed; the stale file removed, its own not yet
    created; its own lock file in place), the second breaks what it judged meanwhile, then the first goes on:
    exactly one of them holds the lock. Each interleaving is forced with events: one refuses the second at the
    claim's name, one lets it find nothing to break, one makes it tell the first's fresh file from the one judged."""
    import threading
    import time

    import eagle31.io
    from eagle31.errors import OutputInUseError
    from eagle31.io import HELD_FILE, STALE_AFTER_S, hold_lock

    held = tmp_path / HELD_FILE
    held.write_bytes(b"")
    old = time.time() - STALE_AFTER_S - 60
    os.utime(held, (old, old))
    both_judged, decided = threading.Barrier(2, timeout=10), threading.Barrier(3, timeout=10)
    first_there, second_done, release = threading.Event(), threading.Event(), threading.Event()
    real_stale, real_link, real_create = eagle31.io._stale_holder, eagle31.io._link, eagle31.io._create_lock_file
    judged: set[str] = set()
    first_creates: list[bool] = []

    def first_stops_here():
        first_there.set()
        second_done.wait(10)

    def stale_holder(path):
        said = real_stale(path)
        name = threading.current_thread().name
        if name not in judged:  # both judge the same stale file before either breaks it
            judged.add(name)
            both_judged.wait()
            if name == "second":
                assert first_there.wait(10), f"the first never got {where}"
        return said

    def link(source, name):
        real_link(source, name)
        if threading.current_thread().name == "first" and where == "claimed" and ".break-" in name.name:
            first_stops_here()  # its claim is linked, the stale file still in place

    def create_lock_file(path, record):
        first = threading.current_thread().name == "first"
        if first and where == "removed" and first_creates == [False]:
            first_stops_here()  # it broke the stale file and has yet to create its own
        created = real_create(path, record)
        if first:
            first_creates.append(created)
            if where == "created" and created:
                first_stops_here()  # its own lock file is in place
        return created

    monkeypatch.setattr(eagle31.io, "_stale_holder", stale_holder)
    monkeypatch.setattr(eagle31.io, "_link", link)
    monkeypatch.setattr(eagle31.io, "_create_lock_file", create_lock_file)
    outcome: dict[str, str] = {}

    def attempt():
        name = threading.current_thread().name
        try:
            with hold_lock(tmp_path):
                outcome[name] = "held"
                if name == "second":
                    second_done.set()
                decided.wait()  # held until both have an outcome
                release.wait(10)
        except OutputInUseError:
            outcome[name] = "refused"
            if name == "second":
                second_done.set()
            decided.wait()

    threads = [threading.Thread(target=attempt, name=name) for name in ("first", "second")]
    for t in threads:
        t.start()
    decided.wait()
    release.set()
    for t in threads:
        t.join(20)
    assert outcome == {holder: "held", ({"first", "second"} - {holder}).pop(): "refused"}, outcome
    assert sorted(os.listdir(tmp_path)) == [".eagle31-lock"]  # the holder let go; no claim left behind


def test_a_breaker_finding_a_fresh_lock_file_in_place_of_the_stale_one_it_judged_leaves_it_alone(
    tmp_path, no_flock, monkeypatch
):
    """The second of two breakers judges the stale lock file, then waits while the first breaks it and takes the
    lock; when the second goes on to break what it judged, the file there is the first's fresh lock: the second
    links it, sees another file than the one judged (inode, mtime, token), leaves it and is refused."""
    import threading
    import time

    import eagle31.io
    from eagle31.errors import OutputInUseError
    from eagle31.io import HELD_FILE, STALE_AFTER_S, hold_lock

    held = tmp_path / HELD_FILE
    held.write_text(json.dumps({"host": "another-node", "pid": 1, "holder": "pid 1 on another-node"}))
    old = time.time() - STALE_AFTER_S - 60
    os.utime(held, (old, old))
    second_judged, first_holds, second_done = threading.Event(), threading.Event(), threading.Event()
    real_stale, real_break = eagle31.io._stale_holder, eagle31.io._break_lock
    breaks: list[tuple[bool, str | None]] = []  # the second's: (broken, the token of the lock file after)

    def stale_holder(path):
        said = real_stale(path)
        if threading.current_thread().name == "second" and not second_judged.is_set():
            second_judged.set()  # it judged the stale file; the first breaks it and takes the lock meanwhile
            first_holds.wait(10)
        return said

    def break_lock(path, identity, holder):
        broken = real_break(path, identity, holder)
        if threading.current_thread().name == "second":
            breaks.append((broken, (eagle31.io._lock_identity(path)[1] or {}).get("token")))
        return broken

    monkeypatch.setattr(eagle31.io, "_stale_holder", stale_holder)
    monkeypatch.setattr(eagle31.io, "_break_lock", break_lock)
    outcome: dict[str, str] = {}
    first_token: list[str | None] = []  # the first's token as it took the lock, then once the second is done

    def first():
        with hold_lock(tmp_path):
            outcome["first"] = "held"
            first_token.append(json.loads(held.read_text())["token"])
            first_holds.set()
            second_done.wait(10)
            first_token.append((eagle31.io._lock_identity(held)[1] or {}).get("token"))

    def second():
        try:
            with hold_lock(tmp_path):
                outcome["second"] = "held"
        except OutputInUseError:
            outcome["second"] = "refused"
        finally:
            second_done.set()

    threads = [threading.Thread(target=second, name="second"), threading.Thread(target=first, name="first")]
    threads[0].start()
    assert second_judged.wait(10)
    threads[1].start()
    for t in threads:
        t.join(20)
    assert outcome == {"first": "held", "second": "refused"}, outcome
    assert first_token[0] == first_token[1]  # its lock file stayed its own while it held the lock
    assert breaks == [(False, first_token[0])]  # the branch of a file linked but not the one judged
    assert sorted(os.listdir(tmp_path)) == [".eagle31-lock"]  # the first let go; no claim left behind


def _hold_lock_in_a_child(directory):
    """A process holding `directory`'s lock file (no flock), until it is killed."""
    import subprocess
    import sys

    code = (
        "import errno, sys, time\n"
        "import eagle31.io\n"
        "def flock(fd, op): raise OSError(errno.ENOLCK, 'No locks available')\n"
        "eagle31.io.fcntl.flock = flock\n"
        f"with eagle31.io.hold_lock({str(directory)!r}):\n"
        "    print('held', flush=True); time.sleep(120)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_lock_file_of_a_killed_holder_is_taken_over_but_not_one_of_another_pid_namespace(tmp_path, no_flock, capsys):
    """A holder SIGKILLed on this host: its pid is gone, the lock is taken over at once. The same file as a
    process of another PID namespace would write it (a container sharing the hostname, where that pid may
    well be alive): its fresh heartbeat keeps it, whatever our namespace says of the pid."""
    import signal

    from eagle31.errors import OutputInUseError
    from eagle31.io import HELD_FILE, hold_lock

    child = _hold_lock_in_a_child(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    held = tmp_path / HELD_FILE
    record = json.loads(held.read_text())
    assert record["pid"] == child.pid
    with hold_lock(tmp_path):
        pass
    assert f"(pid {child.pid} is gone on this host)" in capsys.readouterr().err

    record["pid_ns"] = "another"  # the same host name, the same pid, another PID namespace
    held.write_text(json.dumps(record))
    with pytest.raises(OutputInUseError, match=f"pid {child.pid} on"), hold_lock(tmp_path):
        pass
    del record["pid_ns"]  # a lock file that does not say its namespace: only its heartbeat tells
    held.write_text(json.dumps(record))
    with pytest.raises(OutputInUseError, match=f"pid {child.pid} on"), hold_lock(tmp_path):
        pass


@pytest.mark.slow
def test_a_breaker_killed_while_breaking_a_lock_file_holds_the_others_off_until_its_claim_is_stale(
    tmp_path, no_flock, monkeypatch, capsys
):
    """A process dies after claiming a stale lock file for breaking and before removing it: the next one is
    refused (the claimant would hold the lock next), until the claim is as old as a stale heartbeat."""
    import subprocess
    import sys
    import time

    import eagle31.io
    from eagle31.errors import OutputInUseError
    from eagle31.io import HELD_FILE, STALE_AFTER_S, hold_lock

    held = tmp_path / HELD_FILE
    held.write_text(json.dumps({"host": "another-node", "pid": 1, "holder": "pid 1 on another-node"}))
    old = time.time() - STALE_AFTER_S - 60
    os.utime(held, (old, old))
    code = (
        "import errno, os\n"
        "import eagle31.io\n"
        "def flock(fd, op): raise OSError(errno.ENOLCK, 'No locks available')\n"
        "eagle31.io.fcntl.flock = flock\n"
        "real = eagle31.io._lock_identity\n"
        "def identity(path):\n"
        "    if '.break-' in path.name: os._exit(9)  # killed with its claim made\n"
        "    return real(path)\n"
        "eagle31.io._lock_identity = identity\n"
        f"with eagle31.io.hold_lock({str(tmp_path)!r}): pass\n"
    )
    child = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], timeout=60)
    assert child.returncode == 9 and held.exists()
    with (
        pytest.raises(OutputInUseError, match="is being taken over by another run from pid 1 on another-node"),
        hold_lock(tmp_path),
    ):
        pass
    monkeypatch.setattr(eagle31.io, "STALE_AFTER_S", 1.0)
    time.sleep(1.5)
    with hold_lock(tmp_path):
        assert json.loads(held.read_text())["pid"] == os.getpid()
    assert "taking over the lock of pid 1 on another-node" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [".eagle31-lock"]


def test_a_filesystem_with_neither_flock_nor_hard_links_is_one_line(tmp_path, no_flock, monkeypatch):
    import errno

    import eagle31.io
    from eagle31.errors import FileAccessError
    from eagle31.io import hold_lock

    def link(source, name):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(eagle31.io.os, "link", link)
    with pytest.raises(FileAccessError, match="filesystem has neither flock nor hard links"), hold_lock(tmp_path):
        pass
    assert os.listdir(tmp_path) == [".eagle31-lock"]  # its record was not left behind
