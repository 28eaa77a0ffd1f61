#!/usr/bin/env bash
# Issue 46's GPU figures in one short lease (one H100 / H200, torch 2.11, no network), every step under its own time
# limit, each result written under OUT as it is taken:
#   OUT=DIR WHEELS=gpu-wheels bash bench/documents_gpu_lease.sh [part]
# part "tests-8k" (default): the wheels (nvidia-cudnn-frontend, torchdata) from WHEELS; the THD / varlen / documents
#   GPU tests; bench_attention_kernels at 8K and 64K (flash varlen vs cuDNN THD per packed call); bench_predictions at
#   8K: plain causal vs documents (FA2 varlen, and cuDNN THD with attention_kernel = "cudnn") eager, the step profiled,
#   and plain vs documents compiled.
# part "64k": the same trainer runs at 64K.
# part "thd": after the THD bindings were cached per batch: its GPU tests, the kernels, documents runs on THD at 8K
#   and 64K, eager and compiled.
set -u
OUT="${OUT:-gpu-out}"
WHEELS="${WHEELS:-gpu-wheels}"
PART="${1:-tests-8k}"
mkdir -p "$OUT"
PY=python3
step() {  # step NAME LIMIT_S CMD...: runs CMD with its output in OUT/NAME.txt and a line in OUT/log.txt
  local name="$1" limit="$2"; shift 2
  local start; start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"
}
{
  nvidia-smi -L
  git rev-parse HEAD 2>/dev/null || echo "commit unknown"
  $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name(0))'
} > "$OUT/env.txt" 2>&1
step wheels 60 $PY -m pip install --no-index --no-deps --disable-pip-version-check --find-links "$WHEELS" \
  nvidia-cudnn-frontend torchdata
$PY -c 'import torch, cudnn; print("cudnn-frontend", getattr(cudnn, "__version__", "?"), "backend",
cudnn.backend_version(), "torch cudnn", torch.backends.cudnn.version())' >> "$OUT/env.txt" 2>&1
if [ "$PART" = "tests-8k" ]; then
  step gpu_tests 150 $PY -m pytest -q -m gpu -p no:cacheprovider --durations=0 tests/gpu/test_gpu_cudnn_thd.py \
    tests/gpu/test_gpu_varlen.py
  step attention_kernels 100 $PY bench/bench_attention_kernels.py --seqs 8192,65536 --reps 5
  step predictions_8k_eager 150 $PY bench/bench_predictions.py --seqs 8192 --ac none --documents off,on \
    --attention-kernel auto,cudnn --profile-step 5 --timeout 70 --measured "$OUT/predictions_8k.json"
  step predictions_8k_compiled 150 $PY bench/bench_predictions.py --seqs 8192 --ac none --documents off,on \
    --compile true --timeout 90 --measured "$OUT/predictions_8k.json"
elif [ "$PART" = "thd" ]; then
  step gpu_tests_thd 70 $PY -m pytest -q -m gpu -p no:cacheprovider --durations=0 tests/gpu/test_gpu_cudnn_thd.py \
    -k "graphs_match or cp1 or frontend"
  step attention_kernels_thd 60 $PY bench/bench_attention_kernels.py --seqs 8192,65536 --reps 5
  step predictions_thd 150 $PY bench/bench_predictions.py --seqs 8192,65536 --ac none --documents on \
    --compile false,true --attention-kernel cudnn --timeout 60 --measured "$OUT/predictions_thd.json"
else
  step predictions_64k_eager 170 $PY bench/bench_predictions.py --seqs 65536 --ac none --documents off,on \
    --attention-kernel auto,cudnn --timeout 80 --measured "$OUT/predictions_64k.json"
  step predictions_64k_compiled 170 $PY bench/bench_predictions.py --seqs 65536 --ac none --documents off,on \
    --compile true --timeout 100 --measured "$OUT/predictions_64k.json"
fi
