"""Run logging on rank 0: a progress bar (rate, tokens/s, ETA), `metrics.jsonl`, and wandb.

wandb runs `offline` by default (files under `<run>/wandb`); `online` or
`disabled` when the recipe says. It receives the same metrics as the JSONL
file and the resolved config with secrets redacted.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tqdm import tqdm

_SECRET = re.compile(r"(token|secret|password|passwd|api[_-]?key|credential|auth)", re.IGNORECASE)


def redact_secrets(obj: Any) -> Any:
    """Copy of a config tree with the values of secret-looking keys replaced by '***'."""
    if isinstance(obj, dict):
        return {k: ("***" if _SECRET.search(str(k)) and v is not None else redact_secrets(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_secrets(v) for v in obj]
    return obj


class RunLogger:
    def __init__(
        self,
        run_dir: Path,
        config: dict,
        *,
        total_steps: int,
        start_step: int,
        is_main: bool,
        wandb_mode: str = "offline",
        wandb_project: str = "eagle31",
        wandb_entity: str | None = None,
        progress: bool = True,
    ):
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        if not is_main:
            return
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress, dynamic_ncols=True)
        if wandb_mode != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity,
                mode=wandb_mode,
                dir=str(run_dir),
                config=redact_secrets(config),
                name=Path(run_dir).name,
                resume="allow",
                settings=wandb.Settings(console="off", silent=True),
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        line = {"step": step, **metrics}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def advance(self, step: int, postfix: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(postfix, refresh=False)

    def write(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
