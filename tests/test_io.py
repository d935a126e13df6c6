"""Atomic writes: all or nothing, no leftovers, ordinary permissions; checksums."""

import hashlib
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from eagle31.io import OUTPUT_MARKER, ForeignDirectoryError, atomic_dir, atomic_path, claim_output_dir, atomic_save_safetensors, atomic_write_json, atomic_write_text, sha256_file


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
    with atomic_dir(dest, kind="k") as tmp:
        (tmp / "x").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dest, kind="k") as tmp:
        (tmp / "x").write_text("new")
        raise RuntimeError("killed")
    assert (dest / "x").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["d"]
    with atomic_dir(dest, kind="k") as tmp:  # success replaces it whole
        (tmp / "y").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == [OUTPUT_MARKER, "y"] and [p.name for p in tmp_path.iterdir()] == ["d"]


def test_a_directory_of_the_user_is_never_replaced_or_written_into(tmp_path):
    user = tmp_path / "project"
    user.mkdir()
    (user / "chats.jsonl").write_text("{}")
    with pytest.raises(ForeignDirectoryError, match="did not write"), atomic_dir(user, kind="prepared-data"):
        pass
    with pytest.raises(ForeignDirectoryError, match="did not write"):
        claim_output_dir(user, "run")
    assert [p.name for p in user.iterdir()] == ["chats.jsonl"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ForeignDirectoryError, match="not a directory"):
        claim_output_dir(tmp_path / "file", "run")


def test_an_output_of_another_kind_is_refused_and_ours_is_reused(tmp_path):
    with atomic_dir(tmp_path / "d", kind="prepared-data") as tmp:
        (tmp / "x").write_text("1")
    with pytest.raises(ForeignDirectoryError, match="a prepared-data output"), atomic_dir(tmp_path / "d", kind="export"):
        pass
    run = claim_output_dir(tmp_path / "run", "run")
    (run / "metrics.jsonl").write_text("")
    assert claim_output_dir(run, "run") == run and (run / "metrics.jsonl").exists()
    with atomic_dir(tmp_path / "d", kind="prepared-data") as tmp:  # ours of this kind: replaced
        (tmp / "y").write_text("2")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [OUTPUT_MARKER, "y"]


def test_written_files_and_directories_follow_the_umask(tmp_path, umask_022):
    """Exports and checkpoints must be readable by other users (a vLLM server under another account)."""
    atomic_write_text(tmp_path / "f.txt", "x")
    atomic_save_safetensors({"w": torch.zeros(2)}, tmp_path / "m.safetensors", save_file)  # it recreates the file
    with atomic_dir(tmp_path / "d", kind="k") as tmp:
        (tmp / "g").write_text("y")
    assert mode(tmp_path / "f.txt") == 0o644 and mode(tmp_path / "m.safetensors") == 0o644 and mode(tmp_path / "d") == 0o755


def test_sha256_reads_in_chunks(tmp_path):
    data = os.urandom(10_000)
    (tmp_path / "b").write_bytes(data)
    assert sha256_file(tmp_path / "b", chunk=4096) == hashlib.sha256(data).hexdigest()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_output_parent_is_refused_before_any_work(tmp_path):
    from eagle31.errors import FileAccessError
    from eagle31.io import check_output_dir

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    try:
        with pytest.raises(FileAccessError, match="permission denied"):
            check_output_dir(locked / "run", "run")
    finally:
        locked.chmod(0o755)


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


def test_a_directory_holding_only_outputs_of_ours_may_be_claimed(tmp_path):
    """`data_prep/prepare.py` writes `<output_dir>/data` before the run claims `<output_dir>`."""
    with atomic_dir(tmp_path / "run" / "data", kind="prepared-data") as tmp:
        (tmp / "report.json").write_text("{}")
    assert claim_output_dir(tmp_path / "run", "run") == tmp_path / "run"
    (tmp_path / "other" / "stuff").mkdir(parents=True)  # a folder of the user's beside ours
    with atomic_dir(tmp_path / "other" / "data", kind="prepared-data") as tmp:
        pass
    with pytest.raises(ForeignDirectoryError, match="did not write"):
        claim_output_dir(tmp_path / "other", "run")
