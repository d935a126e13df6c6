"""docs/quickstart_gpu.md's eagle31 commands, run as the page writes them on a CPU at demo size: the page's own
`RECIPE` and `MODEL`, a tiny Llama for `MODEL_DIR`, an OpenAI-compatible server of it standing in for
`vllm serve`, `torchrun` on one process, and overrides appended that shrink the data, the model's dtype and
the steps. What needs vLLM or a GPU (`vllm serve`, `curl` of its metrics, `device=cuda`) is not run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.data.test_regenerate import ChatServer

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "quickstart_gpu.md"
HYDRA_CLIS = ("data_prep/regenerate.py", "data_prep/prepare.py", "train/main.py")
CLIS = (*HYDRA_CLIS, "scripts/export.py")
LOCAL_SERVER = "http://localhost:8000/v1"


def demo_size(chats: Path) -> list[str]:
    """Overrides after the page's own (the last value wins): the tiny target in float32, a few short samples and
    four steps on the CPU."""
    return [
        "target.config=null",
        "target.dtype=float32",
        f"regenerate.source=[{chats}]",
        "regenerate.max_new_tokens=16",
        "regenerate.on_length=keep",  # a random model's replies run to the limit
        "regenerate.concurrency=4",
        "data.max_len=64",
        "data.eval_fraction=0.1",
        "drafter.draft_vocab_size=128",
        "features.tokens_per_batch=256",
        "features.capture_batch_tokens=256",
        "train.max_steps=4",
        "train.warmup_steps=1",
        "train.save_every=2",
        "train.eval_every=2",
        "train.device=cpu",
        "train.precision=fp32",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
    ]


def page_commands() -> tuple[dict[str, str], list[str]]:
    """The page's `export` variables and its command lines that run an eagle31 CLI, continuations joined."""
    variables: dict[str, str] = {}
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.M | re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["export"]:
                variables.update(w.split("=", 1) for w in words[1:])
            elif any(cli in words for cli in CLIS):
                commands.append(line.split(" #")[0].strip())
    return variables, commands


def on_this_machine(command: str, server_url: str, overrides: list[str]) -> str:
    """`command` with this interpreter, the repository's scripts by absolute path, torchrun on one process, the
    stand-in server's URL, and `overrides` after a recipe CLI's arguments."""
    command = re.sub(
        r"^torchrun --nproc-per-node \d+ ", f"{sys.executable} -m torch.distributed.run --nproc-per-node 1 ", command
    )
    command = re.sub(r"^python ", f"{sys.executable} ", command)
    command = re.sub(r"(?<![\w/.])(data_prep|train|scripts)/", rf"{ROOT}/\1/", command)
    command = command.replace(LOCAL_SERVER, server_url)
    if any(cli in command for cli in HYDRA_CLIS):
        command += " " + " ".join(shlex.quote(o) for o in overrides)
    return command


@pytest.mark.slow  # five CLI processes of a tiny target: about 2 minutes on 2 idle cores
def test_the_gpu_quickstart_runs_at_demo_size_on_a_cpu(tiny_target, chats, tmp_path):
    variables, commands = page_commands()
    assert variables["RECIPE"] in ("llama31_8b", "qwen3_8b") and variables["MODEL"]
    ran = [next(cli for cli in CLIS if cli in c) + (" dry_run" if "dry_run=true" in c else "") for c in commands]
    assert ran == [
        "data_prep/regenerate.py",
        "data_prep/prepare.py",
        "train/main.py dry_run",
        "train/main.py",
        "scripts/export.py",
    ], "the quickstart's steps changed: keep this test running each of them"
    run = tmp_path / "run"
    env = {
        **os.environ,
        **variables,
        "MODEL_DIR": str(tiny_target),
        "RUN": str(run),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    outputs = []
    with ChatServer(tiny_target) as server:
        for command in commands:
            line = on_this_machine(command, server.url, demo_size(chats))
            proc = subprocess.run(
                ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )  # a hang guard
            assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
            outputs.append(proc.stdout + proc.stderr)
    assert "memory per GPU" in outputs[2] and "longest T that fits 8 GPU(s) of 80 GiB" in outputs[2]
    assert (run / "regenerated" / "report.json").is_file() and (run / "data" / "train").is_dir()
    assert (run / "export" / "eagle3" / "config.json").is_file() and (run / "export" / "speculators").is_dir()
    assert (tmp_path / "exports" / f"{variables['RECIPE']}-eagle3" / "config.json").is_file()
