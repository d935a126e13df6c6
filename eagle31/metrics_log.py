"""Run logging on rank 0: a progress bar, `metrics.jsonl`, wandb; configs with secrets redacted (docs/training.md)."""

from __future__ import annotations

import json
import os
import re
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle31.errors import CorruptDataError
from eagle31.io import atomic_write_text

# keys naming a credential anywhere in a config tree, compared whole: `shard_max_tokens` is a setting
SECRET_KEYS = frozenset(
    {"token", "hf_token", "hub_token", "access_token", "auth_token", "api_key", "wandb_api_key", "password", "secret"}
)
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")  # what huggingface_hub and wandb read
# credentials by their form: a Hugging Face token, a URL's password, a token= / api_key= / password= parameter
_SECRET_VALUE = re.compile(
    r"(?P<hf>hf_[A-Za-z0-9]{30,})"
    r"|(?<=://)(?P<userinfo>[^/@\s:]*:[^/@\s]+)@"
    r"|(?P<param>[?&](?:token|api_key|apikey|password)=)[^&#\s]+",
    re.IGNORECASE,
)
REDACTED = "***"
ONLINE_INIT_TIMEOUT_S = 30  # wandb retries for 90 s by default before giving up on the server


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


def redact_secrets(obj: Any) -> Any:
    """Copy of a config tree with its credentials replaced by '***', all else unchanged (docs/training.md)."""
    secrets = [v for v in (os.environ.get(name) for name in SECRET_ENV_VARS) if v and len(v) >= 8]
    return _redact(obj, secrets)


def _redact(obj: Any, secrets: list[str]) -> Any:
    if isinstance(obj, dict):
        return {
            k: (REDACTED if str(k).lower() in SECRET_KEYS and v is not None else _redact(v, secrets))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        for secret in secrets:
            obj = obj.replace(secret, REDACTED)
        return _SECRET_VALUE.sub(_mask, obj)
    return obj


def _mask(match: re.Match) -> str:
    return REDACTED + "@" if match.group("userinfo") else (match.group("param") or "") + REDACTED


def start_wandb(mode: str, **init_kwargs: Any):
    """`wandb.init` in `mode`; an `online` start that cannot reach or log in falls back to offline, with one warning."""
    import wandb

    def init(mode: Any):  # WandbMode's values
        timeout = {"init_timeout": ONLINE_INIT_TIMEOUT_S} if mode == "online" else {}
        return wandb.init(mode=mode, settings=wandb.Settings(console="off", silent=True, **timeout), **init_kwargs)

    if mode != "online":
        return init(mode)
    try:
        return init("online")
    except (wandb.errors.CommError, wandb.errors.UsageError, wandb.errors.AuthenticationError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(
            f"warning: logging.wandb.mode=online could not start ({redact_secrets(reason)}); logging offline "
            f"instead, upload later with `wandb sync {init_kwargs.get('dir', '.')}/wandb`",
            file=sys.stderr,
        )
        return init("offline")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a run's `metrics.jsonl`, each a dict of its step and metrics."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int, evaluated: bool = True) -> int:
    """Drop metrics.jsonl's lines after `step` (and its eval's unless `evaluated`), a torn last; return how many."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    keep = []
    for n, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines):
                break
            raise CorruptDataError(f"{path}:{n} is not a JSON line; fix or remove it to resume") from None
        at = record["step"]
        if at < step or (at == step and (evaluated or not any(k.startswith("eval/") for k in record))):
            keep.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


class RunLogger:
    """Rank 0's progress bar, metrics.jsonl lines and wandb run; every call a no-op on the other ranks."""

    def __init__(self, run_dir: Path, config: dict, *, total_steps: int, start_step: int, is_main: bool,
                 wandb_mode: str = "offline", wandb_project: str = "eagle31", wandb_entity: str | None = None,
                 progress: bool = True):  # fmt: skip
        self.is_main = is_main
        self.path = Path(run_dir) / "metrics.jsonl"
        self.bar = self.wandb = None
        if not is_main:
            return
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress, dynamic_ncols=True
        )
        if wandb_mode != "disabled":
            self.wandb = start_wandb(wandb_mode, project=wandb_project, entity=wandb_entity, dir=str(run_dir),
                                     config=redact_secrets(config), name=Path(run_dir).name,
                                     resume="allow")  # fmt: skip

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
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
