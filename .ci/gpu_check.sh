#!/usr/bin/env bash
# `make gpu-check`: everything that needs a GPU, on a machine whose python already has a CUDA torch
# (nothing is downloaded). Builds the CUDA extension in place, runs the whole test suite with the CUDA
# cases enabled, runs compute-sanitizer (memcheck, racecheck) over the CUDA tests of every kernel, and
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
if command -v "$SANITIZER" >/dev/null; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    "$SANITIZER" --tool "$tool" --error-exitcode 1 --target-processes all \
      "$PY" -m pytest -q -p no:cacheprovider -k "cuda" -m "not profiler" tests/test_overflow.py tests/test_optim.py tests/test_lamb.py \
        tests/test_lion.py tests/test_scaler.py tests/test_gemm.py tests/test_nn.py tests/test_random.py \
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
