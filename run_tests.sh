#!/usr/bin/env bash
# Run the tests:  ./run_tests.sh [--slow | --gpu] [pytest args]
#   default: the fast tier (minutes);  --slow: the fast and the slow tier (multi-rank end-to-end runs); with no
#          pytest args, on nproc+1 (at most 4) pytest-xdist workers; any pytest arg runs exactly what it says
#   --gpu: the GPU tier only (CUDA variants of tests/gpu, on the GPUs this machine has); prints the device, torch
#          and CUDA versions; without a visible GPU it prints one line and exits 0; when nvidia-smi lists GPUs but
#          torch has no CUDA it prints one line (how to install a CUDA torch with TORCH_SPEC) and exits 1
#   --gpu --report [OUTDIR]: checks a freshly booted GPU node in one command (harness/gpu_report.py, at most 8
#          minutes on one H100): WHEELS=DIR first installs DIR/*.whl, then each GPU test file under its own time
#          limit, bench/bench_gpu.py --short and one 64K-token step against the dry run; logs and summary.md go to
#          OUTDIR, by default bench/measurements/<gpu>_gpu_report_<date>
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/bootstrap.sh" requirements.txt requirements-test.txt
# glibc's malloc hands every freed block above 128 KiB back to the kernel (munmap, or a trimmed heap top), so each
# training step of the tests' small models faulted the same pages in again and the kernel zeroed them: ~540,000
# page faults and 1.0-1.2 s of system time per 50 forward/backward passes of the passkey model, 12-15% of its CPU.
# Blocks up to 32 MiB now come from the heap and up to 1 GiB of it stays with the process (docs/testing.md).
export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"

marker=(-m "not slow and not gpu")
args=()
report=""
while [ $# -gt 0 ]; do
  case "$1" in
    --slow) marker=(-m "not gpu") ;;
    --gpu) marker=(-m gpu) ;;
    --report)
      report="default"  # harness/gpu_report.py names the folder: bench/measurements/<gpu>_gpu_report_<date>
      if [ $# -ge 2 ] && [ "${2#-}" = "$2" ]; then
        case "$2" in /*) report="$2" ;; *) report="$PWD/$2" ;; esac  # the caller's folder: the script cds below
        shift
      fi ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [ -n "$report" ] && { [ "${marker[1]}" != "gpu" ] || [ ${#args[@]} -gt 0 ]; }; then
  echo "error: --report goes with --gpu and nothing else: ./run_tests.sh --gpu --report [OUTDIR]" >&2
  exit 2
fi
case "${WHEELS:-/}" in /*) ;; *) export WHEELS="$PWD/$WHEELS" ;; esac  # the caller's folder too
cd "$HERE"
if [ "${marker[1]}" = "gpu" ]; then
  # GPUs the driver lists (nvidia-smi ignores CUDA_VISIBLE_DEVICES; an empty or -1 value hides them all from torch)
  listed=0
  if command -v nvidia-smi >/dev/null 2>&1; then listed="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"; fi
  if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ] || [ "${CUDA_VISIBLE_DEVICES-unset}" = "-1" ]; then listed=0; fi
  read -r gpus torch_version cuda_version name < <("$PY" -c 'import torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, torch.__version__, torch.version.cuda or "none", torch.cuda.get_device_name(0) if n else "")')
  if [ "$gpus" = "0" ] && [ "$listed" != "0" ]; then
    echo "GPU tier: nvidia-smi lists $listed GPU(s) but torch $torch_version has no CUDA; install a CUDA torch: unset PYTHON and run TORCH_SPEC=\"torch==2.13.0 --index-url <your CUDA wheel index>\" ./run_tests.sh --gpu"
    exit 1
  fi
  if [ "$gpus" = "0" ]; then
    echo "GPU tier: no GPU visible to torch $torch_version, so nothing ran"
    exit 0
  fi
  echo "GPU tier: $gpus x $name, torch $torch_version, CUDA $cuda_version"
  if [ "$report" = "default" ]; then exec "$PY" -m harness.gpu_report; fi
  if [ -n "$report" ]; then exec "$PY" -m harness.gpu_report "$report"; fi
fi
if [ ${#args[@]} -eq 0 ] && [ "${marker[1]}" != "gpu" ]; then
  # The whole tier with nothing else asked: on pytest-xdist workers, one more than the cores (most tests are one
  # single-threaded process that also waits on ranks it started), at most 4 (each may hold an 8-rank run's memory).
  # Work is handed out as CI does (tests/conftest.py: a file per unit, the long ones first). Any pytest argument
  # (a path, -k, -n 0, -p no:xdist) turns this off: what is given runs as written.
  workers=$(( $(nproc 2>/dev/null || echo 1) + 1 ))
  if [ "$workers" -gt 4 ]; then workers=4; fi
  args=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
exec "$PY" -m pytest "${marker[@]}" "${args[@]}"
