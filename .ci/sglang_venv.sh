#!/usr/bin/env bash
# SGLang 0.5.23's venv, next to (never inside) the project's environment: tests/export/sglang_peer.py
# runs SGLang's own config parsing, weight loading and drafter forward (LlamaForCausalLMEagle3,
# Eagle3DeepseekV2ForCausalLM) on eagle31's exports there. Only that CPU-side code is used, so the
# wheel goes in with --no-deps, with SGLang's own pins of torch (2.14.1, the registry's CUDA build:
# no CPU build of it exists there, and SGLang's configs import torchvision, whose registry builds
# need that torch) and of transformers, and the packages its model modules import (their
# ImportErrors name them). Every wheel (torch's CUDA libraries are ~2.5 GB of them) is cached in
# $EAGLE31_PEERS/wheels and the venv installed from there alone, so a rebuild downloads nothing; the
# venv is rebuilt only when its stamp (the package list it was built with) differs.
#   bash .ci/sglang_venv.sh
set -euo pipefail
. "$(dirname "$0")/peer_venv_lib.sh"
VERSION=0.5.23
venv="$PEERS/sglang-$VERSION"
TORCH=(torch==2.14.1 torchvision==0.29.1)
DEPS=(transformers==5.19.0 compressed-tensors==0.18.0 openai==2.8.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11
      orjson psutil pybase64 requests pillow starlette msgspec pyzmq ipython aiohttp dill gguf einops
      partial-json-parser)
want="${TORCH[*]} ${DEPS[*]}"
peer_venv_cached "$venv" "$want" && exit 0
fresh_peer_venv "$venv" sglang "$VERSION" "${TORCH[@]}"
py="$venv/bin/python"
cached_install "$venv" "${TORCH[@]}" "${DEPS[@]}"  # torch pinned: the resolver keeps the cached build
"$py" -c "import sglang.srt.models.llama_eagle3, sglang.srt.models.kimi_k25_eagle3" >/dev/null
stamp_peer_venv "$venv" "$want"
