#!/usr/bin/env bash
# jsparse's two entry points; each sets up everything it needs on a fresh machine.
#   bash run.sh demo [--help | demo options]   the main job: train a small Flax model, sync it
#   bash run.sh test [pytest options]          the test suite
# `demo` installs jsparse with the demo's extra only (flax, optax, matplotlib, tqdm); `test`
# installs the test extra (everything, the demo's extra included) into the same venv.
# The virtual environment lives in .venv (override with JSPARSE_VENV); the interpreter is the
# first of $JSPARSE_PYTHON, python3.13, python3.12, python3, pyenv's 3.12/3.13 that really runs
# and is >= 3.12 (jax 0.12 needs it; an older Python silently gets an older jax).
set -euo pipefail
cd "$(dirname "$0")"
venv="${JSPARSE_VENV:-.venv}"

runs_312() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }

find_python() {
  local candidates=()
  [ -n "${JSPARSE_PYTHON:-}" ] && candidates+=("$JSPARSE_PYTHON")
  candidates+=(python3.13 python3.12 python3)
  if command -v pyenv >/dev/null 2>&1; then
    for d in "$(pyenv root)"/versions/3.1[2-9]*; do [ -x "$d/bin/python3" ] && candidates+=("$d/bin/python3"); done
  fi
  for d in /usr/local/bin /usr/bin /opt/homebrew/bin; do
    for v in 3.13 3.12; do [ -x "$d/python$v" ] && candidates+=("$d/python$v"); done
  done
  for c in "${candidates[@]}"; do
    if runs_312 "$c"; then command -v "$c" 2>/dev/null || echo "$c"; return 0; fi
  done
  echo "jsparse needs Python >= 3.12 (jax 0.12); none found. Set JSPARSE_PYTHON." >&2
  return 1
}

setup() {
  local extra="$1"
  if [ ! -x "$venv/bin/python" ] || ! runs_312 "$venv/bin/python"; then
    local py; py=$(find_python)
    echo "setting up $venv with $py" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
  fi
  # The stamp holds the extra installed and a hash of pyproject.toml. The test extra contains
  # the demo's, so a venv set up for test serves the demo too.
  local stamp="$venv/.jsparse-installed" hash have=""
  hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
  [ -f "$stamp" ] && have=$(cat "$stamp")
  if [ "$have" = "$extra $hash" ] || { [ "$extra" = demo ] && [ "$have" = "test $hash" ]; }; then
    return 0
  fi
  echo "installing jsparse[$extra] and its dependencies into $venv (log: $venv/install.log)" >&2
  if ! { "$venv/bin/python" -m pip install --upgrade pip &&
         "$venv/bin/python" -m pip install -e ".[$extra]"; } >"$venv/install.log" 2>&1; then
    tail -n 30 "$venv/install.log" >&2
    exit 1
  fi
  echo "$extra $hash" > "$stamp"
}

# pytest-xdist's options for `test`, unless the arguments already choose how it runs.
default_workers() {
  local a
  for a in "$@"; do
    case "$a" in -n|-n*|--numprocesses*|--dist*|*no:xdist) return 0 ;; esac
  done
  echo "-n auto --dist loadfile"
}

cmd="${1:-}"; shift || true
case "$cmd" in
  demo) setup demo; exec "$venv/bin/python" -m jsparse.examples.demo "$@" ;;
  # The test files run on every core (pytest-xdist: one worker per core, at most 4, see
  # tests/conftest.py; each file whole on one worker, so a module's processes, servers and Ray
  # start once), unless the arguments choose: `-n 0` runs serially (for --pdb, say).
  test) setup test; exec "$venv/bin/python" -m pytest $(default_workers "$@") "$@" ;;
  *) echo "usage: bash run.sh demo|test [options]" >&2; exit 2 ;;
esac
