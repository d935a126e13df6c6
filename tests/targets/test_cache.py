"""Build-once cache: concurrent callers build once; failed builds leave nothing behind."""

import subprocess
import sys
import textwrap

import pytest

from eagle31.targets.cache import build_atomically, ensure_built, portable_path

# Each process asks for the target; the one that builds it finishes its build only once the other has reached the
# build lock (`seen/lock-<pid>`), or is building too (`seen/build-<pid>`: no lock held them apart), so the two calls
# overlap by construction, not by a sleep. A build is logged to `builds.log`.
_CALLER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import eagle31.targets.cache as cache

    log, seen = Path(sys.argv[1]), Path(sys.argv[2])

    class Lock(cache.FileLock):
        def acquire(self, *args, **kwargs):
            (seen / f"lock-{os.getpid()}").touch()
            return super().acquire(*args, **kwargs)

    cache.FileLock = Lock

    def build(d):
        (seen / f"build-{os.getpid()}").touch()
        with open(log, "a") as f:
            f.write("built\\n")
        deadline = time.monotonic() + 60
        while not [p for p in seen.iterdir() if not p.name.endswith(f"-{os.getpid()}")]:
            assert time.monotonic() < deadline, "the other process never reached the lock"
            time.sleep(0.01)
        (d / "weights.bin").write_bytes(b"x" * 10)

    print(cache.ensure_built("toy", "v1", build))
    """
)


@pytest.mark.slow
def test_concurrent_processes_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE31_CACHE", str(tmp_path / "cache"))
    log, seen = tmp_path / "builds.log", tmp_path / "seen"
    seen.mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", _CALLER, str(log), str(seen)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] == str(tmp_path / "cache" / "targets" / "toy-v1")
    assert log.read_text() == "built\n"
    assert (tmp_path / "cache" / "targets" / "toy-v1" / "weights.bin").read_bytes() == b"x" * 10


def test_a_failed_build_leaves_no_target(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE31_CACHE", str(tmp_path))

    def broken(d):
        (d / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        ensure_built("toy", "v1", broken)
    assert [p.name for p in (tmp_path / "targets").iterdir() if not p.name.endswith(".lock")] == []
    path = ensure_built("toy", "v1", lambda d: (d / "ok").write_text("1"))
    assert (path / "ok").read_text() == "1"


def test_build_atomically_refuses_an_existing_directory(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="out already exists"):
        build_atomically(tmp_path / "out", lambda d: None)


def test_portable_path_names_the_cache_by_its_variable_and_the_checkout_relatively(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE31_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert portable_path(tmp_path / "cache" / "targets" / "demo") == "$EAGLE31_CACHE/targets/demo"
    assert portable_path(tmp_path / "runs" / "x" / "drafter") == "runs/x/drafter"
    assert portable_path("runs/x") == "runs/x"
    assert portable_path("/elsewhere/model") == "/elsewhere/model"
