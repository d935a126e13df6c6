"""Small builders shared by the tests."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from eagle31 import DrafterConfig, Eagle31Drafter
from eagle31.data.batch import FeatureBatch
from eagle31.vocab import vocab_maps


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=24,
        vocab_size=40,
        draft_vocab_size=24,
        target_num_layers=8,
        aux_layer_ids=(2, 4, 5),
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )
    values.update(overrides)
    return DrafterConfig(**values)


def tiny_drafter(seed: int = 0, dtype=torch.float64, std: float = 0.3, **overrides) -> Eagle31Drafter:
    """A random drafter whose weights are large enough that every switch changes the outputs."""
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides)
    m = Eagle31Drafter(cfg)
    m.reset_parameters(std=std)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:  # norms away from ones so that normalisation is visible
                p.copy_(1 + 0.2 * torch.randn_like(p))
        g = torch.Generator().manual_seed(seed + 1)
        draft_ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
        d2t, t2d = vocab_maps(draft_ids, cfg.vocab_size)
        m.init_from_target(
            torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size), d2t, t2d
        )
    return m.to(dtype)


def random_batch(cfg: DrafterConfig, B: int, T: int, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(B, T, cfg.fc_in_features, generator=g).to(dtype) * 2
    final = torch.randn(B, T, cfg.target_hidden_size, generator=g).to(dtype)
    input_ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).long()
    return aux, final, input_ids, loss_mask


def feature_batch(cfg: DrafterConfig, T: int, seed: int = 0, dtype=torch.float32) -> FeatureBatch:
    """One packed row of one document, every position supervised: a `FeatureBatch` for the trainer."""
    aux, final, input_ids, _ = random_batch(cfg, 1, T, seed, dtype)
    return FeatureBatch(
        input_ids=input_ids,
        loss_mask=torch.ones(1, T, dtype=torch.long),
        document_ids=torch.zeros(1, T, dtype=torch.long),
        aux=aux,
        final=final,
    )


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_script(path: Path, argv: list[str], monkeypatch) -> int:
    """`python <path> <argv...>` in this process, through the script's own `__main__` block: its exit code.

    The CLIs are thin shells over library calls, so a subprocess would only add an interpreter
    and a torch import (20-30 s on a busy machine) to what this checks.
    """
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    return exit_.value.code


def base_args(target: Path, data: Path, out: Path, **extra) -> list[str]:
    """The overrides of a 6-step run of the tiny chat target (`tiny_target` fixture) on `data`, into `out`."""
    args = {
        "recipe": "kimi_k26_mini",  # CPU-sized defaults; the target is replaced by the tiny one
        "target.builtin": "null",
        "target.path": str(target),
        "target.name": "tiny",
        "data.source": f"[{data}]",
        "data.max_len": "64",
        "data.eval_fraction": "0.1",
        "drafter.draft_vocab_size": "128",
        "drafter.attention": "llama",  # the tiny target is a Llama (the recipe's MLA drafter needs an MLA target)
        "export.formats": "[eagle3,speculators]",
        "features.tokens_per_batch": "256",
        "train.max_steps": "6",
        "train.save_every": "2",
        "train.log_every": "1",
        "train.lr": "3e-3",
        "output_dir": str(out),
        "logging.progress": "false",
    }
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


def fill_disk(disk: Path, leave_pages: int) -> Path:
    """Fill the file system of `disk` (`small_disk`) but `leave_pages` 4 KiB pages; returns the ballast file to
    delete."""
    import errno
    import os

    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC
        size = f.tell()
    os.truncate(ballast, max(0, size - leave_pages * 4096))
    return ballast


def sigkill_after_checkpoint(cmd: list[str], out: Path, env: dict, step: int = 2, timeout: float = 300) -> None:
    """Start `cmd` (a run into `out`), SIGKILL it once its step-`step` checkpoint is complete, and wait for it."""
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        cmd, env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + timeout
    while not (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "report.json").exists()
