"""Checkpoints: checksums recorded at completion, a damaged newest one passed over, a full disk loses nothing."""

from __future__ import annotations

import errno

import pytest
import torch

from eagle31.checkpoint import CHECKSUMS, CheckpointManager
from eagle31.distributed import World
from eagle31.errors import CorruptCheckpointError, DiskFullError

WORLD = World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def save_steps(manager: CheckpointManager, steps: list[int]) -> dict[int, torch.Tensor]:
    weights = {}
    for step in steps:
        model, optimizer = model_and_optimizer(step)
        manager.save(step, model, optimizer, {"step": step})
        weights[step] = model.weight.detach().clone()
    return weights


def test_a_checkpoint_records_the_checksum_of_every_file(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", WORLD)
    save_steps(manager, [2])
    path = manager.latest()
    recorded = __import__("json").loads((path / CHECKSUMS).read_text())
    on_disk = {p.name for p in path.iterdir()} - {CHECKSUMS, "COMPLETE"}
    assert (
        set(recorded) == on_disk and "trainer_state.json" in recorded and any(n.endswith(".distcp") for n in recorded)
    )
    assert manager.latest_intact() == path


def test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    manager = CheckpointManager(tmp_path / "checkpoints", WORLD, keep_last=2)
    weights = save_steps(manager, [2, 4])
    newest = manager.latest()
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # a kill or a bad copy truncated it
    chosen = manager.latest_intact()
    assert chosen.name == "step_00000002"
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and newest.name in warning[0] and shard.name in warning[0]
    model, optimizer = model_and_optimizer(99)
    assert manager.load(chosen, model, optimizer) == {"step": 2}
    assert torch.equal(model.weight, weights[2])


def test_no_intact_checkpoint_stops_with_one_line(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", WORLD)
    save_steps(manager, [2])
    (manager.latest() / "trainer_state.json").write_text("{}")
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
        manager.latest_intact()


def test_a_full_disk_during_a_checkpoint_loses_nothing(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "checkpoints", WORLD)
    save_steps(manager, [2])
    before = {p.name: p.read_bytes() for p in manager.latest().iterdir()}

    def no_space(*args, **kwargs):  # what a tensor write into a full file system raises
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)  # DCP's file-system writer serialises each tensor with it
    model, optimizer = model_and_optimizer(4)
    with pytest.raises(DiskFullError, match="nothing was lost: .*step_00000002 is intact"):
        manager.save(4, model, optimizer, {"step": 4})
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_00000002"]  # the partial write is gone
    assert {p.name: p.read_bytes() for p in manager.latest().iterdir()} == before
    assert manager.latest_intact().name == "step_00000002"


def test_a_failure_that_is_not_a_full_disk_is_not_disguised(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "checkpoints", WORLD)

    def broken(*args, **kwargs):
        raise ValueError("a bug in a writer")

    monkeypatch.setattr(torch, "save", broken)
    model, optimizer = model_and_optimizer(4)
    with pytest.raises(BaseException) as caught:
        manager.save(4, model, optimizer, {"step": 4})
    assert not isinstance(caught.value, DiskFullError)


def test_a_really_full_disk_during_a_checkpoint_loses_nothing(small_disk):
    """torch's zip writer reports the short write as `unexpected pos`, with no errno: the check must still see it."""
    manager = CheckpointManager(small_disk / "checkpoints", WORLD)
    save_steps(manager, [2])
    torch.manual_seed(0)
    big = torch.nn.Linear(1024, 1024)  # 4 MiB of weights: more than the disk holds
    optimizer = torch.optim.AdamW(big.parameters())
    with pytest.raises(DiskFullError, match="step_00000002 is intact"):
        manager.save(4, big, optimizer, {"step": 4})
    assert sorted(p.name for p in manager.root.iterdir()) == ["step_00000002"]
    assert manager.latest_intact().name == "step_00000002"
