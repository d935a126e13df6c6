"""Training checkpoints with torch.distributed.checkpoint (DCP): atomic, keep-last-N, resumable.

Layout under `<run>/checkpoints/`:

    step_00000200/            a complete checkpoint (renamed into place last)
        .metadata, *.distcp   model + optimizer state (sharded by DCP, any world size)
        trainer_state.json    step, tokens seen, scheduler, data position, ...
        rng_rank{r}.safetensors
        COMPLETE
    step_00000400.tmp/        a checkpoint being written: never taken for the latest

The frozen target embedding is not saved (it is re-read from the target).
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from eagle31.distributed import World, barrier
from eagle31.io import atomic_save_safetensors, atomic_write_json, fsync_dir

_STEP_DIR = re.compile(r"^step_(\d{8})$")
FROZEN_KEYS = ("drafter.embed_tokens.weight",)


@contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when no process group exists: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    def __init__(self, root: str | Path, world: World, keep_last: int = 2):
        self.root = Path(root)
        self.world = world
        self.keep_last = max(1, keep_last)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _STEP_DIR.match(p.name) and (p / "COMPLETE").is_file()]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, model: torch.nn.Module, optimizer, trainer_state: dict) -> Path:
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f"step_{step:08d}.tmp"
        if self.world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        for key in FROZEN_KEYS:
            model_sd.pop(key, None)
        with _quiet_single_process():
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        atomic_save_safetensors(_rng_state(), tmp / f"rng_rank{self.world.rank}.safetensors", save_file)
        barrier()
        if self.world.is_main:
            atomic_write_json(tmp / "trainer_state.json", trainer_state)
            (tmp / "COMPLETE").write_text(f"{step}\n")
            fsync_dir(tmp)
            if final.exists():  # a re-run of the same step after a resume
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_dir(self.root)
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        barrier()
        return final

    def load(self, path: Path, model: torch.nn.Module, optimizer) -> dict:
        """Restore model, optimizer and this rank's RNG in place; return the trainer state."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        for key in FROZEN_KEYS:
            model_sd.pop(key, None)
        state = {"model": model_sd, "optim": optim_sd}
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
            _set_rng_state(load_file(str(rng)))
        return json.loads((path / "trainer_state.json").read_text())
