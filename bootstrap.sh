# Sourced by run_train.sh and run_tests.sh: picks a Python that has the pinned requirements, or makes .venv with them.
#   PYTHON=/path/to/python   use that interpreter as it is (no checks, no installs)
#   TORCH_SPEC="..."         pip arguments that replace the pinned torch line, e.g. a CUDA build:
#                            TORCH_SPEC="torch==2.13.0 --index-url <your CUDA wheel index>"
# Usage: source bootstrap.sh REQUIREMENTS_FILE...   -> sets PY
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

_requirements_met() {  # python, files...
  local py="$1"; shift
  TORCH_SPEC="${TORCH_SPEC:-}" "$py" - "$@" <<'PYEOF' 2>/dev/null
import os, sys
from importlib.metadata import version, PackageNotFoundError
for path in sys.argv[1:]:
    for line in open(path):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, _, want = line.partition("==")
        if name == "torch" and os.environ.get("TORCH_SPEC"):
            # any torch would pass the pin once the local suffix (+cpu) is dropped: the interpreter must hold the
            # torch that this exact TORCH_SPEC installed (recorded below), or it is reinstalled
            recorded = os.path.join(sys.prefix, ".torch_spec")
            if not os.path.exists(recorded) or open(recorded).read().strip() != os.environ["TORCH_SPEC"].strip():
                sys.exit(1)
            want = ""
        try:
            have = version(name).split("+")[0]
        except PackageNotFoundError:
            sys.exit(1)
        if want and have != want:
            sys.exit(1)
PYEOF
}

_bootstrap() {
  local files=() f
  for f in "$@"; do files+=("$ROOT/$f"); done
  if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"; return; fi
  if [ -x "$ROOT/.venv/bin/python" ] && _requirements_met "$ROOT/.venv/bin/python" "${files[@]}"; then
    PY="$ROOT/.venv/bin/python"; return
  fi
  local sys_py; sys_py="$(command -v python3 || command -v python)"
  if [ -n "$sys_py" ] && _requirements_met "$sys_py" "${files[@]}"; then PY="$sys_py"; return; fi
  echo "[bootstrap] installing pinned requirements into $ROOT/.venv (first run only, under a minute) ..." >&2
  [ -x "$ROOT/.venv/bin/python" ] || "$sys_py" -m venv "$ROOT/.venv" || { echo "error: could not create .venv (is python3-venv installed?)" >&2; exit 1; }
  # --no-compile: pip would byte-compile all ~12,000 modules of the requirements (torch's, transformers', ...), half
  # of the install's minute on one core; the few thousand that runs import are compiled once below instead.
  local pip=("$ROOT/.venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile)
  if [ -n "${TORCH_SPEC:-}" ]; then
    # shellcheck disable=SC2086
    "${pip[@]}" $TORCH_SPEC || { echo "error: pip install $TORCH_SPEC failed" >&2; exit 1; }
    printf '%s\n' "$TORCH_SPEC" > "$ROOT/.venv/.torch_spec"
    local filtered; filtered="$(mktemp)"
    cat "${files[@]}" | grep -vE '^torch==' > "$filtered"
    files=("$filtered")
  fi
  local args=(); for f in "${files[@]}"; do args+=(-r "$f"); done
  "${pip[@]}" "${args[@]}" 2> >(grep -v "^WARNING: Location" >&2) || { echo "error: installing ${files[*]} failed (see pip's message above)" >&2; exit 1; }
  PY="$ROOT/.venv/bin/python"
  _compile_what_runs_import
}

_compile_what_runs_import() {
  # What the trainer, its compile path and the tests import, byte-compiled into the venv once (even where
  # PYTHONDONTWRITEBYTECODE is set, which would otherwise make every process compile them again), in two processes
  # (two cores): ~14 s on the 2-core box, where the whole install now takes ~50 s (69 s with pip compiling all).
  local names pids=()
  for names in "train torch._dynamo torch._inductor.compile_fx torch._inductor.codegen.cpp torch.distributed.checkpoint
                torch.distributed.pipelining torchdata.stateful_dataloader sentencepiece torchao.float8 pytest xdist
                pytest_timeout" \
               "torch.utils.tensorboard safetensors.torch tokenizers pyarrow transformers matplotlib.pyplot jinja2 tqdm
                transformers.models.llama.modeling_llama transformers.models.qwen2.modeling_qwen2
                transformers.models.qwen3.modeling_qwen3"; do
    # shellcheck disable=SC2086
    PYTHONPATH="$ROOT" env -u PYTHONDONTWRITEBYTECODE "$PY" -c '
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # a package this install left out (the test requirements): nothing to compile
        pass' $names >/dev/null 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
}

_bootstrap "$@"
