#!/usr/bin/env bash
# Train from a recipe:  ./run_train.sh [RECIPE.toml] [--section.key value ...] [--print-config]
#   NPROC=N     local ranks (default: the product of the recipe's parallel degrees, dp_shard = -1 counted as 1)
#   PYTHON, TORCH_SPEC: see bootstrap.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/bootstrap.sh" requirements.txt

for arg in "$@"; do
  if [ "$arg" = "--print-config" ]; then exec "$PY" "$HERE/train.py" "$@"; fi
done
# Validate the recipe and the launch in one process first: bad input is one line, never a torchrun traceback wall.
ranks="$(NPROC="${NPROC:-}" "$PY" "$HERE/train.py" --check "$@")" || exit $?
NPROC="${NPROC:-$ranks}"
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$HERE/train.py" "$@"
