"""Inference workers that fail on purpose, for the engine's tests (imported by the Ray actors: a module, not a test).

Where a failure happens once, a file in the target directory says at which computation (`<name>`: n), and the
first worker to get there renames it (to `<done>`), so the worker that takes its place, and any other, goes on."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from ray.exceptions import ActorUnavailableError

from eagle31.engine.transport import MooncakeTransport
from eagle31.engine.worker import HFInferenceWorker, VLLMInferenceWorker
from eagle31.target import TargetFeatures


def due(worker, name: str, done: str) -> bool:
    """Whether this computation of `worker` is the one the file `name` in its target directory names (`always`: all)."""
    marker = Path(worker.spec.target_dir) / name
    try:
        when = marker.read_text().strip()
    except FileNotFoundError:  # none, or another worker has just renamed it
        return False
    if when == "always":
        return True
    if worker.calls != int(when):
        return False
    try:
        marker.rename(marker.with_name(done))
    except FileNotFoundError:  # another worker got there first
        return False
    return True


class Faulty:
    """Counts its computations (`calls`) and, at the one its target directory's files name, fails:
    `die_at` (-> `died`): ends its own process in the middle of it, as the OOM killer would;
    `hang_at` (-> `hung`): stops answering, alive and holding its requests;
    `unreachable_at` (-> `unreachable`): raises the error Ray gives a caller whose actor is briefly unreachable,
    which Ray hands to the pool as that class (no death)."""

    calls = 0

    def features(self, token_rows):
        self.calls += 1
        if due(self, "die_at", "died"):
            os._exit(1)
        if due(self, "hang_at", "hung"):
            time.sleep(3600)
        if due(self, "unreachable_at", "unreachable"):
            raise ActorUnavailableError("the connection to the actor was lost for a moment", None)
        return super().features(token_rows)


class FaultyWorker(Faulty, HFInferenceWorker):
    """The HF worker that fails where its files say (`Faulty`)."""


class FaultyVLLMWorker(Faulty, VLLMInferenceWorker):
    """The vLLM worker that fails where its files say (`Faulty`); its engine's processes go with it."""


class RaisingWorker(HFInferenceWorker):
    """A worker whose computation fails with its own error (it would fail again: no restart)."""

    def features(self, token_rows):
        raise ValueError(f"cannot compute {len(token_rows)} rows")


class UndescribedWorker(HFInferenceWorker):
    """A worker that loads the target but cannot describe itself (as a vLLM engine whose first answer is unreadable)."""

    def describe(self):
        raise RuntimeError("the engine's first answer is unreadable")


class ShiftedHooksWorker(HFInferenceWorker):
    """A worker whose hooks sit one layer above the ids it was given (the spec says one thing, the engine does
    another): its description must show the layers it really keeps."""

    def __init__(self, spec):
        super().__init__(spec)
        self.hooks = TargetFeatures(self.model, [i + 1 for i in spec.aux_layer_ids])


class SilentPool:
    """A feature pool (a Ray actor) that never answers: `stalled_s` of no progress, or (None) not even its state."""

    def __init__(self, stalled_s: float | None):
        self.stalled_s = stalled_s

    async def take(self, rank, ids):
        await asyncio.sleep(3600)

    async def state(self):
        if self.stalled_s is None:
            await asyncio.sleep(3600)
        return {"stalled_s": self.stalled_s, "limit_s": 1.0, "line": "worker 0 ready for 9 s holding 2 request(s)"}


class ReadKeysMooncake(MooncakeTransport):
    """transport=mooncake that remembers, in the ranks' process, the keys the ranks have read (`read`)."""

    def __init__(self, address, segment_bytes: int):
        super().__init__(address, segment_bytes)
        self.read: list[str] = []

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "read": []}

    def consumed(self, pool, handles: list) -> None:
        self.read += handles
        super().consumed(pool, handles)
