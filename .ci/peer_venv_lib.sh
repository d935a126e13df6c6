# Sourced by the peer venv scripts: where the venvs and the cached wheels live, each venv's stamp (the
# package list it was built with: a venv is rebuilt only when it differs), and a fresh venv with the
# CPU build of torch and one peer's wheel installed --no-deps (the wheel cached in $WHEELS).
#   peer_venv_cached <venv dir> "<package list>" && exit 0    # says so when the stamp matches
#   fresh_peer_venv <venv dir> <package> <version> [torch...] # then: "$venv/bin/python" -m pip install <its imports>
#                                                             # (torch: the CPU build of 2.13.0 unless named, then
#                                                             # from $WHEELS as cached_install puts it there)
#   cached_install <venv dir> <requirement>...                # the requirements and their dependencies installed
#                                                             # from $WHEELS alone, downloaded there first (only
#                                                             # what is not there yet) if it lacks any
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

cached_install() {
  local venv=$1
  "$venv/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" "${@:2}" 2>/dev/null && return
  "$venv/bin/python" -m pip download --quiet --only-binary :all: -d "$WHEELS" "${@:2}"
  "$venv/bin/python" -m pip install --quiet --no-index --find-links "$WHEELS" "${@:2}"
}

fresh_peer_venv() {
  local venv=$1 package=$2 version=$3 torch=("${@:4}")
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  if [ ${#torch[@]} -eq 0 ]; then
    "$venv/bin/python" -m pip install --quiet torch==2.13.0
  else
    cached_install "$venv" "${torch[@]}"
  fi
  ls "$WHEELS/$package-$version"-*.whl >/dev/null 2>&1 || "$venv/bin/python" -m pip download --quiet --no-deps "$package==$version" -d "$WHEELS"
  "$venv/bin/python" -m pip install --quiet --no-deps "$WHEELS/$package-$version"-*.whl
}
