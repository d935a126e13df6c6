# Sourced by the peer venv scripts: a fresh venv with the CPU build of torch and one peer's wheel
# installed --no-deps (the wheel cached in $WHEELS).
#   fresh_peer_venv <venv dir> <package> <version>     # then: "$venv/bin/python" -m pip install <its imports>
fresh_peer_venv() {
  local venv=$1 package=$2 version=$3
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet torch==2.13.0
  ls "$WHEELS/$package-$version"-*.whl >/dev/null 2>&1 || "$venv/bin/python" -m pip download --quiet --no-deps "$package==$version" -d "$WHEELS"
  "$venv/bin/python" -m pip install --quiet --no-deps "$WHEELS/$package-$version"-*.whl
}
