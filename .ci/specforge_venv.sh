#!/usr/bin/env bash
# SpecForge 0.2.0's venv, next to (never inside) the project's environment: the side-by-side runs
# its own trainer there (experiments/side_by_side/specforge_training.py). SpecForge pins torch==2.11.0,
# transformers==5.8.1 and sglang==0.5.14; its offline EAGLE-3 training path imports no sglang
# (only its online capture does), so the wheel goes in with --no-deps, with the CPU build of
# torch 2.13.0 (not their pin), their transformers pin and the packages that path imports.
# triton: specforge.core.loss imports it at module top (its kernel never runs on a CPU). Their
# torch.compile'd helpers (the teacher's softmax, the reference loss) need a C++ compiler. The
# wheel is cached in $EAGLE31_PEERS/wheels; the venv is rebuilt only when its stamp (the
# package list it was built with) differs.
#   bash .ci/specforge_venv.sh
set -euo pipefail
. "$(dirname "$0")/peer_venv_lib.sh"
VERSION=0.2.0
venv="$PEERS/specforge-$VERSION"
DEPS=(transformers==5.8.1 datasets accelerate pydantic pyyaml safetensors numpy tqdm psutil huggingface_hub triton)
want="torch==2.13.0 ${DEPS[*]}"
peer_venv_cached "$venv" "$want" && exit 0
fresh_peer_venv "$venv" specforge "$VERSION"
py="$venv/bin/python"
"$py" -m pip install --quiet "${DEPS[@]}"
"$py" -c "import specforge.cli, specforge.algorithms.eagle3.model, specforge.export.to_hf" >/dev/null
stamp_peer_venv "$venv" "$want"
