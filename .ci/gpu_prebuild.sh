#!/usr/bin/env bash
# Builds, on a machine without a GPU, the CUDA extension that a GPU machine will load, so that its short GPU
# window is not spent in nvcc. The GPU machine's stack is named below (its Python, its torch, its GPU's
# arch); the extension is built against the very same torch release from PyPI, in a venv of that Python,
# and left with its key in build/gpu-prebuilt/:
#
#   _C.<ext suffix>      the extension (CPU and CUDA kernels, for GPU_ARCHS)
#   _build_config.py     what mpfused/_ops.py checks before loading it
#   PREBUILT             the key: a hash of the sources, torch's version and git commit, the extension
#                        suffix (Python's ABI), the archs
#
# `.ci/gpu_check.sh build` on the GPU machine compares the key with its own sources, torch and Python and
# reuses the extension when every part matches and the visible GPUs' archs are among GPU_ARCHS; otherwise
# it builds from source as before and says which part differed.
#
#   GPU_PYTHON       the GPU machine's Python, major.minor (default 3.12); an interpreter of that version
#                    is looked up as pythonX.Y on PATH, then under pyenv (GPU_PYTHON_BIN names one)
#   GPU_TORCH_SPEC   the GPU machine's torch (default torch==2.11.0: PyPI's build of it is CUDA 13.0)
#   GPU_ARCHS        TORCH_CUDA_ARCH_LIST of the build (default 9.0: H100 and H200)
#   GPU_VENV         the venv (default .venv-gpu<X><Y>; it holds CUDA torch and its libraries, ~5 GB)
#   JOBS             parallel compile jobs (default: every core)
#   GPU_PREBUILD_TESTS   test files run on this machine's CPU against the prebuilt extension under the GPU
#                    machine's torch before it is kept (default: the torch.compile, operator and nn tests,
#                    where a torch release differs most; "none" for none): what fails here fails there too
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GPU_PYTHON=${GPU_PYTHON:-3.12}
GPU_TORCH_SPEC=${GPU_TORCH_SPEC:-torch==2.11.0}
GPU_ARCHS=${GPU_ARCHS:-9.0}
GPU_VENV=${GPU_VENV:-$ROOT/.venv-gpu${GPU_PYTHON//./}}
JOBS=${JOBS:-$(nproc)}
OUTDIR=$ROOT/build/gpu-prebuilt
export PIP_DISABLE_PIP_VERSION_CHECK=1

find_python() {
  if [ -n "${GPU_PYTHON_BIN:-}" ]; then echo "$GPU_PYTHON_BIN"; return; fi
  if command -v "python$GPU_PYTHON" >/dev/null && "python$GPU_PYTHON" -c "" 2>/dev/null; then
    command -v "python$GPU_PYTHON"; return
  fi
  if command -v pyenv >/dev/null; then
    local v
    for v in $(pyenv versions --bare 2>/dev/null | grep -E "^${GPU_PYTHON//./\\.}(\.[0-9]+)?$" | sort -V -r); do
      if [ -x "$(pyenv root)/versions/$v/bin/python$GPU_PYTHON" ]; then
        echo "$(pyenv root)/versions/$v/bin/python$GPU_PYTHON"; return
      fi
    done
  fi
  return 1
}

command -v nvcc >/dev/null || [ -n "${CUDA_HOME:-}" ] || { echo "gpu_prebuild: no nvcc on PATH and no CUDA_HOME" >&2; exit 1; }
if [ ! -x "$GPU_VENV/bin/python" ]; then
  py=$(find_python) || { echo "gpu_prebuild: no Python $GPU_PYTHON found (set GPU_PYTHON_BIN)" >&2; exit 1; }
  "$py" -m venv "$GPU_VENV"
fi
# (the constraint file of a machine may cap torch below the GPU machine's release: this venv is its own)
PIP_CONSTRAINT= "$GPU_VENV/bin/python" -m pip install --progress-bar off -q "$GPU_TORCH_SPEC" numpy 'setuptools>=77' wheel ninja \
  pytest hypothesis
"$GPU_VENV/bin/python" -c "import torch; assert torch.version.cuda, 'gpu_prebuild: $GPU_TORCH_SPEC has no CUDA'"

# Build from a copy of the tree (the source tree's own in-place build is left alone).
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
tar --exclude=./build --exclude='./.venv*' --exclude='./mpfused/_C*.so' --exclude=./mpfused/_build_config.py \
    --exclude=./.git --exclude=./benchmarks/results --exclude=./.whl -cf - . | tar -xf - -C "$WORK"
start=$SECONDS
(cd "$WORK" && TORCH_CUDA_ARCH_LIST="$GPU_ARCHS" MAX_JOBS=$JOBS "$GPU_VENV/bin/python" setup.py -q build_ext --inplace)
echo "gpu_prebuild: nvcc and g++ took $((SECONDS - start)) s"

# The key, computed by the same code that checks it on the GPU machine.
key=$(cd "$WORK" && bash .ci/gpu_check.sh --key "$GPU_VENV/bin/python") || { echo "gpu_prebuild: no key" >&2; exit 1; }
# It loads (no GPU here: the CUDA kernels are linked in, none is launched).
(cd "$WORK" && "$GPU_VENV/bin/python" -c "
import mpfused
assert mpfused.has_cuda_kernels(), 'built without the CUDA kernels'
print('gpu_prebuild: loads;', mpfused.build_info())")

# The CPU side under the GPU machine's torch (no GPU here: the CUDA cases skip)
tests=${GPU_PREBUILD_TESTS:-tests/test_compile.py tests/test_torch_ops.py tests/test_nn.py}
if [ "$tests" != none ]; then
  # shellcheck disable=SC2086
  if ! (cd "$WORK" && CUDA_VISIBLE_DEVICES= TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 "$GPU_VENV/bin/python" -m pytest -q \
          -p no:cacheprovider $tests); then
    echo "gpu_prebuild: these tests fail under $GPU_TORCH_SPEC (the GPU machine's torch) on this CPU already:" \
         "fix them before the GPU window; nothing was kept" >&2
    exit 1
  fi
fi

rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
cp "$WORK"/mpfused/_C*.so "$WORK"/mpfused/_build_config.py "$OUTDIR"/
{ echo "$key"; echo "archs=$GPU_ARCHS"; } > "$OUTDIR/PREBUILT"
echo "gpu_prebuild: $OUTDIR ($(du -sh "$OUTDIR" | cut -f1)):"
sed 's/^/  /' "$OUTDIR/PREBUILT"
