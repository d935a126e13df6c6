"""DCP training checkpoints: atomic, checksummed, keep-last-N, resumed from the newest intact (docs/design.md §6)."""

from __future__ import annotations

import json
import re
import shutil
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from enum import StrEnum
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from eagle31.distributed import World, barrier, broadcast_object
from eagle31.errors import CorruptCheckpointError, DiskFullError
from eagle31.io import atomic_save_safetensors, atomic_write_json, fsync_dir, is_disk_full, sha256_file

_STEP_DIR = re.compile(r"^step_(\d{8})$")
FROZEN_KEYS = ("drafter.embed_tokens.weight",)
CHECKSUMS = "checksums.json"
_NEARLY_FULL = 64 << 20  # bytes free below which a failed write is taken for a full disk


class Resume(StrEnum):
    never = "never"  # an output_dir holding a run is refused
    auto = "auto"  # continue from the latest checkpoint of the same run


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _trained_state(model: torch.nn.Module, optimizer) -> dict[str, dict]:
    """{"model", "optim"}: the state dicts a checkpoint holds (the frozen embedding left out)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": {k: v for k, v in model_sd.items() if k not in FROZEN_KEYS}, "optim": optim_sd}


class CheckpointManager:
    """The checkpoints under `root`: saved by every rank, the last `keep_last` kept, the newest intact one found."""

    def __init__(self, root: str | Path, world: World, keep_last: int = 2):
        self.root, self.world, self.keep_last = Path(root), world, max(1, keep_last)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        return [None, *self.complete()][-1]

    def latest_intact(self) -> Path | None:
        """The newest checkpoint matching its checksums, rank 0 judging; None if none yet, raises if none is intact."""
        choice: tuple[str | None, str | None] = (None, None)  # (path, error)
        if self.world.is_main:
            done = self.complete()
            for path in reversed(done):
                if (problem := damage(path)) is None:
                    choice = (str(path), None)
                    break
                print(f"warning: checkpoint {path} is damaged ({problem}); trying an older one", file=sys.stderr)
            if done and choice[0] is None:
                choice = (
                    None,
                    f"no intact checkpoint in {self.root} ({len(done)} damaged); remove the checkpoints "
                    "directory to start over, or restore it from a backup",
                )
        path, error = broadcast_object(choice, self.world.device)
        if error:
            raise CorruptCheckpointError(error)
        return Path(path) if path else None

    def save(self, step: int, model: torch.nn.Module, optimizer, trainer_state: dict) -> Path:
        """Checkpoint `step` (model, `optimizer` or a list of them, each rank's RNG, `trainer_state`) via a tmp dir."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        previous = self.latest()
        try:
            self._write(tmp, step, model, optimizer, trainer_state)
        except BaseException as e:  # DCP wraps write failures in CheckpointException, a BaseException
            if isinstance(e, KeyboardInterrupt) or not _disk_full(e, self.root):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            kept = f"{previous} is intact" if previous else "no earlier checkpoint existed"
            raise DiskFullError(
                f"the disk holding {self.root} filled up while writing checkpoint {final.name}; nothing was lost: "
                f"{kept} (the partial write was removed); free space, then rerun with resume=auto"
            ) from None
        if self.world.is_main:
            fsync_dir(tmp)
            if final.exists():  # a re-run of the same step after a resume
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_dir(self.root)
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def _write(self, tmp: Path, step: int, model: torch.nn.Module, optimizer, trainer_state: dict) -> None:
        """Every file of the checkpoint into `tmp`, then (rank 0) the checksums and COMPLETE."""
        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        with _quiet_single_process():
            dcp.save(_trained_state(model, optimizer), checkpoint_id=str(tmp))
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        atomic_save_safetensors(rng, tmp / f"rng_rank{self.world.rank}.safetensors", save_file)
        barrier()
        if self.world.is_main:
            atomic_write_json(tmp / "trainer_state.json", trainer_state)
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            atomic_write_json(tmp / CHECKSUMS, {name: sha256_file(tmp / name) for name in files})
            (tmp / "COMPLETE").write_text(f"{step}\n")

    def load(self, path: Path, model: torch.nn.Module, optimizer) -> dict:
        """Restore model, optimizer (one, or the list saved) and this rank's RNG in place; return the trainer state."""
        state = _trained_state(model, optimizer)
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=False),
        )
        rng = path / f"rng_rank{self.world.rank}.safetensors"
        if rng.is_file():  # absent when resuming on more ranks than were saved
            saved = load_file(str(rng))
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved["cuda"])
        return read_trainer_state(path)


def read_trainer_state(checkpoint: str | Path) -> dict:
    """A checkpoint's trainer_state.json: step, tokens, scheduler, data positions (rank 0's `data`, `data_ranks`)."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


def damage(path: Path) -> str | None:
    """What is wrong with a complete checkpoint's files (missing, changed), or None when they match."""
    try:
        recorded = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return f"{CHECKSUMS} missing or unreadable"
    for name, digest in recorded.items():
        file = path / name
        if not file.is_file():
            return f"{name} missing"
        if sha256_file(file) != digest:
            return f"{name} does not match its checksum"
    return None


def _disk_full(e: BaseException, root: Path) -> bool:
    """Whether a failed write ran out of space: ENOSPC, or little space left (torch's zip writer has no errno)."""
    if is_disk_full(e):
        return True
    with suppress(OSError):
        return shutil.disk_usage(root).free < _NEARLY_FULL
    return False
