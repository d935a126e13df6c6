"""Inference workers that fail on purpose, for the engine's tests (imported by the Ray actors: a module, not a test)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle31.engine.worker import HFInferenceWorker


class DyingWorker(HFInferenceWorker):
    """Ends its own process in the middle of its n-th computation, as the OOM killer would, where the file
    `die_at` in the target directory says n; the first worker to get there renames the file to `died`, so
    the one that takes its place (and any other) lives on. `die_at` holding `always`: every worker dies
    in its first computation."""

    def __init__(self, spec):
        super().__init__(spec)
        self.calls = 0

    def features(self, token_rows):
        self.calls += 1
        marker = Path(self.spec.target_dir) / "die_at"
        when = marker.read_text().strip() if marker.is_file() else None
        if when == "always":
            os._exit(1)
        if when is not None and self.calls == int(when):
            try:
                marker.rename(marker.with_name("died"))
            except FileNotFoundError:  # another worker got there first
                pass
            else:
                os._exit(1)
        return super().features(token_rows)


class RaisingWorker(HFInferenceWorker):
    """A worker whose computation fails with its own error (it would fail again: no restart)."""

    def features(self, token_rows):
        raise ValueError(f"cannot compute {len(token_rows)} rows")
