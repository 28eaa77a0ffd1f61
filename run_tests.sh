#!/usr/bin/env bash
# Run the tests:  ./run_tests.sh [--slow | --gpu] [pytest args]
#   default: the fast tier (minutes);  --slow: the fast and the slow tier (multi-rank end-to-end runs)
#   --gpu: the GPU tier only (CUDA variants of tests/gpu, on the GPUs this machine has); without a visible GPU it
#          prints one line and exits 0
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/bootstrap.sh" requirements.txt requirements-test.txt

marker=(-m "not slow and not gpu")
args=()
for arg in "$@"; do
  case "$arg" in
    --slow) marker=(-m "not gpu") ;;
    --gpu) marker=(-m gpu) ;;
    *) args+=("$arg") ;;
  esac
done
cd "$HERE"
if [ "${marker[1]}" = "gpu" ]; then
  read -r gpus torch_version name < <("$PY" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, torch.__version__, torch.cuda.get_device_name(0) if n else "")')
  if [ "$gpus" = "0" ]; then
    echo "GPU tier: no GPU visible to torch $torch_version, so nothing ran"
    exit 0
  fi
  echo "GPU tier: $gpus x $name, torch $torch_version"
fi
exec "$PY" -m pytest "${marker[@]}" "${args[@]}"
