# Sourced by the peer venv scripts: where the venvs and the cached wheels live, each venv's stamp (the
# package list it was built with: a venv is rebuilt only when it differs), and a fresh venv with the
# CPU build of torch and one peer's wheel installed --no-deps (the wheel cached in $WHEELS).
#   peer_venv_cached <venv dir> "<package list>" && exit 0    # says so when the stamp matches
#   fresh_peer_venv <venv dir> <package> <version> [torch...] # then: "$venv/bin/python" -m pip install <its imports>
#                                                             # (torch: the CPU build of 2.13.0 unless named)
#   stamp_peer_venv <venv dir> "<package list>"               # once the venv imports what it must
PEERS="${EAGLE31_PEERS:-$HOME/.cache/eagle31-peers}"
WHEELS="$PEERS/wheels"
mkdir -p "$WHEELS"

peer_venv_cached() {
  local venv=$1 want=$2
  [ -f "$venv/.eagle31-ready" ] && [ "$(cat "$venv/.eagle31-ready")" = "$want" ] && echo "$(basename "$venv"): $venv (cached)"
}

stamp_peer_venv() {
  local venv=$1 want=$2
  echo "$want" > "$venv/.eagle31-ready"
  echo "$(basename "$venv"): $venv"
}

fresh_peer_venv() {
  local venv=$1 package=$2 version=$3 torch=("${@:4}")
  [ ${#torch[@]} -gt 0 ] || torch=(torch==2.13.0)
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "${torch[@]}"
  ls "$WHEELS/$package-$version"-*.whl >/dev/null 2>&1 || "$venv/bin/python" -m pip download --quiet --no-deps "$package==$version" -d "$WHEELS"
  "$venv/bin/python" -m pip install --quiet --no-deps "$WHEELS/$package-$version"-*.whl
}
