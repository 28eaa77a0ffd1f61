#!/usr/bin/env bash
# Second call of the 2026-12-04 lease: what the first call's limits cut, run side by side, each under its own timeout.
set -u
R="$OUT/r2"; mkdir -p "$R"
export PYTHON=python3 PIP_BREAK_SYSTEM_PACKAGES=1 PYTHONPATH="$PWD"
python3 -m pip install -q --no-index --no-deps --disable-pip-version-check gpu-wheels/*.whl > "$R/wheels.log" 2>&1
t() { local name="$1" lim="$2"; shift 2; local s=$(date +%s); timeout "$lim" "$@" > "$R/$name.log" 2>&1; echo "$name: exit $? after $(( $(date +%s) - s )) s" >> "$R/steps.txt"; }
P="python3 -m pytest -m gpu -p no:cacheprovider -ra --durations=0 --timeout=150 --timeout-method=thread"
t compiled_op 200 python3 -m harness.gpu_report --compiled-op "$R/compiled_op" &
t kernels 200 $P tests/gpu/test_gpu_varlen.py tests/gpu/test_gpu_cudnn_thd.py tests/gpu/test_gpu_block_kernels.py &
t cp 200 $P tests/gpu/test_gpu_cp.py tests/gpu/test_gpu_documents_layout.py tests/gpu/test_gpu_float8.py &
t memory 200 $P tests/gpu/test_gpu_memory.py tests/gpu/test_gpu_cpu_offload.py &
t trainer 215 $P tests/gpu/test_gpu_trainer.py &
wait
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$R/steps.txt" 2>&1
cd "$OUT" && tar czf r2.tgz r2 && rm -rf r2
