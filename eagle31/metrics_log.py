"""Run logging on rank 0: a progress bar, `metrics.jsonl` and wandb, configs with secrets redacted (docs/training.md)."""

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


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# Keys that name a credential wherever they sit in a config tree. The whole key is compared,
# never a part of it: `num_speculative_tokens` or `shard_max_tokens` are settings, not secrets.
SECRET_KEYS = frozenset(
    {"token", "hf_token", "hub_token", "access_token", "auth_token", "api_key", "wandb_api_key", "password", "secret"}
)
# Environment variables that hold the credentials this project's tools read (huggingface_hub, wandb).
SECRET_ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
# Credentials recognised by their form, wherever they appear in a value: a Hugging Face token
# (`hf_` + 30 or more letters and digits), the password of a URL (`scheme://user:password@host`)
# and a `token=`/`api_key=`/`password=` query parameter.
_SECRET_VALUE = re.compile(
    r"(?P<hf>hf_[A-Za-z0-9]{30,})"
    r"|(?<=://)(?P<userinfo>[^/@\s:]*:[^/@\s]+)@"
    r"|(?P<param>[?&](?:token|api_key|apikey|password)=)[^&#\s]+",
    re.IGNORECASE,
)
REDACTED = "***"


def redact_secrets(obj: Any) -> Any:
    """Copy of a config tree with its credentials (`SECRET_KEYS`' values, `_SECRET_VALUE`, `SECRET_ENV_VARS`' values
    inside strings) replaced by '***'; everything else unchanged, so a run's `config.yaml` reads back as it ran."""
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
    if match.group("userinfo"):
        return REDACTED + "@"
    return (match.group("param") or "") + REDACTED


ONLINE_INIT_TIMEOUT_S = 30  # wandb retries for 90 s by default before giving up on the server


def start_wandb(mode: str, **init_kwargs: Any):
    """`wandb.init` in `mode`; an `online` start that cannot reach or log in falls back to offline with one warning line
    (the metrics stay under `<run>/wandb`, for `wandb sync`)."""
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
    """Keep the lines of metrics.jsonl logged at or before `step` (and before its evaluation unless `evaluated`), and no
    torn last line; return how many were dropped."""
    path = Path(path)
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
        logged_later = record["step"] > step or (
            record["step"] == step and not evaluated and any(k.startswith("eval/") for k in record)
        )
        if not logged_later:
            keep.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)


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
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", disable=not progress, dynamic_ncols=True
        )
        if wandb_mode != "disabled":
            self.wandb = start_wandb(
                wandb_mode,
                project=wandb_project,
                entity=wandb_entity,
                dir=str(run_dir),
                config=redact_secrets(config),
                name=Path(run_dir).name,
                resume="allow",
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
