#!/usr/bin/env bash
# `make gpu-check`: everything that needs a GPU, on a machine whose python already has a CUDA torch
# (nothing is downloaded). Builds the CUDA extension in place, runs the whole test suite with the CUDA
# cases enabled, runs compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over the CUDA tests of every kernel, and
# runs the benchmarks, writing their JSON under benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

"$PY" -c "import torch; assert torch.cuda.is_available(), 'gpu-check needs a visible CUDA device'"
MAX_JOBS=$(nproc) "$PY" setup.py -q build_ext --inplace
"$PY" -m mpfused
"$PY" -c "import mpfused; assert mpfused.has_cuda_kernels(), 'the extension was built without CUDA'"

echo "== pytest (cpu and cuda)"
"$PY" -m pytest -q tests

SANITIZER=${COMPUTE_SANITIZER:-compute-sanitizer}
if ! command -v "$SANITIZER" >/dev/null && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]; then
  SANITIZER="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"
fi
if command -v "$SANITIZER" >/dev/null; then
  # Only mpfused's kernels are instrumented (every one lives in namespace mpf: "mpf" is in each name), and
  # torch's caching allocator is off, so that an access past a tensor's end lands outside any allocation
  # (inside a cached block memcheck cannot see it). If this compute-sanitizer does not take the filter, the
  # stage runs unfiltered and says so.
  FILTER=(--kernel-name kns=mpf)
  if ! "$SANITIZER" "${FILTER[@]}" --tool memcheck --error-exitcode 1 "$PY" -c "pass" >/dev/null 2>&1; then
    echo "gpu-check: compute-sanitizer rejected '${FILTER[*]}': instrumenting every kernel" >&2
    FILTER=()
  fi
  for tool in memcheck racecheck synccheck initcheck; do
    echo "== compute-sanitizer --tool $tool"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" "${FILTER[@]}" --error-exitcode 1 --target-processes all \
      "$PY" -m pytest -q -p no:cacheprovider -k "cuda" -m "not profiler and not big" tests/test_overflow.py tests/test_optim.py \
        tests/test_lamb.py tests/test_lion.py tests/test_scaler.py tests/test_gemm.py tests/test_nn.py tests/test_random.py \
        tests/test_fixed_point.py tests/test_optim_precision.py tests/test_torch_ops.py
  done
else
  echo "gpu-check: compute-sanitizer not found" >&2
  exit 1
fi

echo "== benchmarks"
for bench in benchmarks/bench_*.py; do  # as modules of the benchmarks package, from the root (the in-place build)
  "$PY" -m "benchmarks.$(basename "$bench" .py)" --device cuda --json
done
echo "gpu-check: OK; results in benchmarks/results/"
