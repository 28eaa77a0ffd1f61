#!/usr/bin/env bash
# Run the tests:  ./run_tests.sh [--slow] [pytest args]
#   default: the fast tier (minutes);  --slow: the fast and the slow tier (multi-rank end-to-end runs)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/bootstrap.sh" requirements.txt requirements-test.txt

marker=(-m "not slow")
args=()
for arg in "$@"; do
  if [ "$arg" = "--slow" ]; then marker=(); else args+=("$arg"); fi
done
cd "$HERE"
exec "$PY" -m pytest "${marker[@]}" "${args[@]}"
