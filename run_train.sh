#!/usr/bin/env bash
# Train from a recipe:  ./run_train.sh [RECIPE.toml] [--section.key value ...] [--print-config | --dry-run | --prepare-data]
#   --help [SECTION], -h  the modes, overrides and sections; with a section, its keys (type, default, meaning)
#   --dry-run       plan check in one process: memory per rank and step time per stage on a fake process group
#   --prepare-data  tokenize the recipe's sources once into the memory-mapped store (data.cache_dir), then stop
#   --show-rows N [--json]  print the first N training rows of the first stage (label spans, sources), then stop
#   --plan-ramp --gpus N --target-seq-len L [--out F] [--offload auto|on|off] [--stages K] [--tokens-per-stage T]
#                   write a recipe whose [[ramp]] stages grow the context to L on N GPUs, every stage measured to fit
#   NPROC=N     local ranks (default: the product of the recipe's parallel degrees, dp_shard = -1 counted as 1)
#   RANK_START=exec  each rank a fresh interpreter, as torchrun starts it; default `fork`: forked from the launcher's
#               imports (training/warm_ranks.py), which saves each rank importing torch and the trainer again
#   PYTHON, TORCH_SPEC: see bootstrap.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/bootstrap.sh" requirements.txt

for arg in "$@"; do  # one process, no torchrun: printing the config, or the dry run on a fake process group
  case "$arg" in --help|-h|--print-config|--dry-run|--prepare-data|--show-rows|--plan-ramp) exec "$PY" "$HERE/train.py" "$@" ;; esac
done
# Inside a job of slurm/train.sbatch (one task per node; it exports RDZV_ENDPOINT and NPROC = ranks per node), every
# node's torchrun meets the others at the head node's c10d rendezvous, keyed by the job id. Elsewhere: one machine.
launch=(--standalone)
nodes=1
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${RDZV_ENDPOINT:-}" ]; then
  nodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
  launch=(--nnodes "$nodes" --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$SLURM_JOB_ID")
fi
# Validate the recipe and the launch first: bad input is one line, never a torchrun traceback wall. The check runs in
# the launcher's own process, before torchrun (training/launcher.py check_then_size), which also splits the cores
# between the local ranks as train.py would (OMP_NUM_THREADS, unless set: no torchrun banner on every run).
world=""
if [ -n "${NPROC:-}" ]; then world=$((nodes * NPROC)); fi
for arg in "$@"; do  # --check alone: the ranks it would launch, printed once, and no torchrun
  if [ "$arg" = "--check" ]; then WORLD_SIZE="$world" exec "$PY" "$HERE/train.py" "$@"; fi
done
# A recipe that does not load stops here in one line, before anything imports torch (config/command_line.py)
PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m config.command_line "$@" || exit $?
# MAX_RESTARTS=N: torchrun restarts the job after a rank dies and it resumes from the newest complete checkpoint. A
# restarted job needs a fresh rendezvous store: torch 2.13's shared one hands it the dead ranks' stale gloo addresses.
# Signals: torchrun forwards SIGTERM and SIGUSR1 to the ranks, which finish their step, save it and exit; it waits
# STOP_GRACE_S seconds (default 600) for that before it kills them (torch 2.11 has no --shutdown-timeout: the launcher
# applies it there). training/launcher.py runs torchrun so that the exit
# code says why the run stopped: 0 after a save on SIGTERM, 75 (requeue) after a save on SIGUSR1, 76 after a hang's
# line (a collective timed out, no restart left: slurm/train.sbatch requeues); a rank the kernel's OOM killer
# SIGKILLed (it leaves no word of its own) gets one last line naming the signal, the rank and the plan.
exec env TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-$(( ${MAX_RESTARTS:-0} > 0 ))}" \
  TRAIN_CHECK_WORLD_SIZE="$world" PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m training.launcher "${launch[@]}" \
  --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout "${STOP_GRACE_S:-600}" \
  --max-restarts "${MAX_RESTARTS:-0}" --nproc-per-node "${NPROC:-auto}" "$HERE/train.py" "$@"
