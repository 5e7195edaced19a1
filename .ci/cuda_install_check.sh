#!/usr/bin/env bash
# The real GPU user's install path, proven on a machine without a GPU:
#   a venv with the CUDA-enabled torch from PyPI, then `pip install --no-build-isolation mpfused-<version>.tar.gz`,
#   the source distribution of the tree (as a package index would serve it; made where no CUDA is asked for, so
#   that it is shown to hold the CUDA sources whatever builds it), nvcc building the CUDA kernels for
#   INSTALL_ARCHS (below); then import the installed package and assert that build_info() reports CUDA. The CPU
#   tests then run against that installed CUDA build.
# It also proves the ABI guard: the source tree's own extension (built by `make test` against the CPU
# torch) must refuse to load under this other torch with a clear message.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=${MPFUSED_CUDA_VENV:-$ROOT/.venv-cuda}
CUDA_TORCH_SPEC=${CUDA_TORCH_SPEC:-torch==2.14.1}
JOBS=${JOBS:-$(nproc)}
# The archs of this build: one, with its PTX. Every .cu is compiled for every arch by `make cuda-compile`
# (the compile check, whose SASS .ci/check_sass.py reads); here the point is the install path itself, and
# each further arch would only add minutes of nvcc. A user's `pip install` builds setup.py's default list.
INSTALL_ARCHS=${INSTALL_ARCHS:-9.0+PTX}

command -v nvcc >/dev/null || [ -n "${CUDA_HOME:-}" ] || { echo "cuda_install_check: no nvcc and no CUDA_HOME" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --progress-bar off -q "$CUDA_TORCH_SPEC" numpy 'setuptools>=77' wheel ninja pytest pytest-xdist hypothesis rich tqdm matplotlib
"$VENV/bin/python" -c "import torch; assert torch.version.cuda, 'expected a CUDA-enabled torch'; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
# --venv-only: the venv alone (.ci/run prepares it in the background while `make test` runs: unpacking
# CUDA torch's gigabytes is mostly disk and decompression, which overlaps the compiles and the tests).
if [ "${1:-}" = "--venv-only" ]; then
  echo "cuda_install_check: venv ready"
  exit 0
fi

# Build from a copy of the tree (build/cuda-install/tree), so that the source tree's in-place CPU build is
# left alone. --build-only stops after the install; a later run (a rerun of `make cuda-check`) finds that
# install and does not build again. The
# install is keyed by the content of every file git does not ignore (a tree object written from a scratch
# index), the archs, torch, nvcc, the venv and the debug-info switch, and by the hash of the installed
# extension; outside a git checkout there is no key, and it always builds.
INSTALL_DIR=$ROOT/build/cuda-install
WORK=$INSTALL_DIR/tree
in_git() { git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; }
tree_key() {
  in_git || return 1
  local index tree
  index=$(mktemp)
  cp "$(git -C "$ROOT" rev-parse --git-path index)" "$index" 2>/dev/null || rm -f "$index"
  tree=$(cd "$ROOT" && GIT_INDEX_FILE=$index git add -A && GIT_INDEX_FILE=$index git write-tree) || { rm -f "$index"; return 1; }
  rm -f "$index"
  { echo "tree=$tree archs=$INSTALL_ARCHS venv=$VENV debug=${MPFUSED_DEBUG_INFO:-}"
    "$VENV/bin/python" -c "import torch; print(torch.__version__)"; nvcc --version 2>/dev/null | tail -n 2; } | sha256sum | cut -d' ' -f1
}
# The hash of the extension installed in the venv (looked up from outside any source tree), or nothing.
installed_hash() {
  local so
  so=$(cd / && "$VENV/bin/python" -P -c "import glob, importlib.util, os
spec = importlib.util.find_spec('mpfused')
found = glob.glob(os.path.join(os.path.dirname(spec.origin), '_C*.so')) if spec else []
print(found[0] if found else '')" 2>/dev/null) || return 0
  [ -n "$so" ] && [ -f "$so" ] && sha256sum "$so" | cut -d' ' -f1
}
key=$(tree_key) || key=""
if [ -n "$key" ] && [ -d "$WORK/tests" ] && [ -n "$(installed_hash)" ] &&
   [ "$(cat "$INSTALL_DIR/KEY" 2>/dev/null)" = "$key $(installed_hash)" ]; then
  echo "cuda_install_check: reusing the install built from this tree ($INSTALL_DIR/KEY)"
  rm -rf "$WORK/build" "$WORK"/mpfused/_C*.so "$WORK/mpfused/_build_config.py"  # (a last run's prebuilt copy)
else
  rm -rf "$INSTALL_DIR"
  mkdir -p "$WORK"
  if in_git; then
    # the files git does not ignore: a copy made while `make test` writes its (ignored) files beside them
    (cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$WORK"
  else
    tar --exclude=./build --exclude='./.venv*' --exclude='./mpfused/_C*.so' --exclude=./mpfused/_build_config.py \
        --exclude=./benchmarks/results -cf - . | tar -xf - -C "$WORK"
  fi
  (cd "$WORK" && MPFUSED_FORCE_CPU=1 "$VENV/bin/python" setup.py -q sdist --dist-dir "$INSTALL_DIR/sdist")
  sdist=$(echo "$INSTALL_DIR"/sdist/mpfused-*.tar.gz)
  [ -f "$sdist" ] || { echo "cuda_install_check: setup.py sdist made no archive in $INSTALL_DIR/sdist" >&2; exit 1; }
  TORCH_CUDA_ARCH_LIST="$INSTALL_ARCHS" MAX_JOBS=$JOBS "$VENV/bin/python" -m pip install --no-build-isolation --no-deps \
      --progress-bar off "$sdist"
  [ -z "$key" ] || echo "$key $(installed_hash)" > "$INSTALL_DIR/KEY"
fi
if [ "${1:-}" = "--build-only" ]; then
  echo "cuda_install_check: installed"
  exit 0
fi

# Import the *installed* package (from outside the source tree) and check what it was built with.
cd "$WORK/tests"
INSTALL_ARCHS="$INSTALL_ARCHS" "$VENV/bin/python" - <<'EOF'
import os, torch, mpfused
info = mpfused.build_info()
print("installed mpfused:", info)
assert mpfused.__file__.find("site-packages") >= 0, mpfused.__file__
assert info["cuda_version"] is not None, "the CUDA build reports no CUDA"
assert info["torch_version"] == torch.__version__, info
assert info["cuda_arch_list"] == os.environ["INSTALL_ARCHS"], info
assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0], (info, torch.version.cuda)
EOF
"$VENV/bin/python" -m mpfused
# The CPU tests against the installed CUDA build (CUDA cases skip: no GPU here): every file that imports
# or registers something the install could lose (the ops, torch.compile, nn, scaler, amp, the optimizers'
# precision modes, every kernel family once). Left out, because `make test` already ran them on the same
# CPU code and here they would only repeat it at length: the CPU-path matrix (test_cpu_isa), the large
# optimizer and GEMM grids (test_optim, test_gemm), the multi-process runs (test_distributed,
# test_scaler_distributed, test_dcp, test_fsdp2_example), the GPU script's own checks (its stages and its
# profile summary) and the benchmark harness's timing loop: these import the benchmarks package of the
# source tree, which the install does not carry.
SKIP_REPEATS=(test_cpu_isa.py test_optim.py test_gemm.py test_distributed.py test_scaler_distributed.py test_dcp.py
              test_fsdp2_example.py test_gpu_check_script.py test_profile_kernels.py test_bench_harness.py)
# (CUDA_VISIBLE_DEVICES empty: on a machine with a GPU of another arch than INSTALL_ARCHS, its CUDA cases
# would find no kernel image; this check is about the CPU side of the CUDA build.)
# (JOBS test processes, as `make test` runs them: one alone keeps about 1.2 cores busy)
CUDA_VISIBLE_DEVICES= "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "$JOBS" "${SKIP_REPEATS[@]/#/--ignore=$WORK/tests/}" "$WORK/tests"

# The GPU window's reuse of a prebuilt extension (.ci/gpu_check.sh build, after .ci/gpu_prebuild.sh), with
# this CUDA build standing in for the prebuilt one: its key is taken as gpu_prebuild.sh takes it, and the
# build stage's check must accept it for its arch, put it in the source tree and load it from there.
pkg=$(cd "$WORK/tests" && "$VENV/bin/python" -c "import mpfused, os; print(os.path.dirname(mpfused.__file__))")
mkdir -p "$WORK/build/gpu-prebuilt"
cp "$pkg"/_C*.so "$pkg"/_build_config.py "$WORK/build/gpu-prebuilt/"
{ bash "$WORK/.ci/gpu_check.sh" --key "$VENV/bin/python"; echo "archs=$INSTALL_ARCHS"; } > "$WORK/build/gpu-prebuilt/PREBUILT"
out=$(PYTHON="$VENV/bin/python" bash "$WORK/.ci/gpu_check.sh" --reuse "${INSTALL_ARCHS%+PTX}" 2>&1) || {
  echo "cuda_install_check: the build stage refused the prebuilt extension:" >&2; echo "$out" >&2; exit 1; }
echo "$out" | grep -q "^reusing the extension prebuilt" || { echo "unexpected: $out" >&2; exit 1; }
(cd "$WORK" && "$VENV/bin/python" -c "import mpfused; assert mpfused.__file__.startswith('$WORK'), mpfused.__file__")
echo "prebuilt reuse: OK ($out)"

# The ABI guard: the source tree's extension was built against another torch.
if ls "$ROOT"/mpfused/_C*.so >/dev/null 2>&1; then
  cd "$ROOT"
  if out=$("$VENV/bin/python" -c "import mpfused" 2>&1); then
    echo "cuda_install_check: the source tree's extension loaded under a different torch" >&2
    exit 1
  fi
  echo "$out" | grep -q "was built against torch" || { echo "unclear ABI error: $out" >&2; exit 1; }
  echo "ABI guard: OK ($(echo "$out" | tail -1 | cut -c1-160)...)"
fi
echo "cuda_install_check: OK"
