#!/usr/bin/env bash
# The GPU check, in stages that each fit a short GPU window (9 minutes: `timeout 540` around each), on a
# machine whose python already has a CUDA torch (nothing is downloaded). A stage given files or
# benchmark names keeps a summary line of its own (e.g. sanitize-memcheck-gemm):
#
#   bash .ci/gpu_check.sh deps        every tool and Python package the stages need, each missing one named
#                                     (fails on a missing package or GPU; a missing nvcc or compute-sanitizer
#                                     fails only the stages that need it: a build from source, sanitize)
#   bash .ci/gpu_check.sh build       the extension in place for the visible GPUs' archs only, all cores;
#                                     leaves mpfused/_C*.so and build/ for the later stages (no rebuild);
#                                     or, where .ci/gpu_prebuild.sh left one for this very machine (sources,
#                                     torch, Python, arch: build/gpu-prebuilt/PREBUILT), that extension
#   bash .ci/gpu_check.sh tests [FILE...]
#                                     the GPU cases of the test suite (pytest -m cuda) and the demo on the
#                                     GPU, or the GPU cases of FILE...
#   bash .ci/gpu_check.sh sanitize TOOL [FILE...]
#                                     compute-sanitizer TOOL (memcheck, racecheck, synccheck, initcheck) over
#                                     the GPU cases marked `sanitize` in the kernel test files (SANITIZE_ALL=1:
#                                     all their GPU cases), or over every GPU case of FILE...
#   bash .ci/gpu_check.sh bench [NAME...]
#                                     the benchmarks (or benchmarks/NAME.py) on CUDA, short repetition mode,
#                                     JSON under benchmarks/results/ named after the GPU
#   bash .ci/gpu_check.sh bench-cpu   issue 13's CPU benchmarks (stochastic rounding) on this machine's cores,
#                                     JSON under benchmarks/results/<name>_cpu_<isa>_<N>cpus.json
#   bash .ci/gpu_check.sh profile [WORKLOAD...]
#                                     Nsight Compute (ncu) over the kernels behind the missed goals
#                                     (benchmarks/profile_kernels.py): one table of DRAM and SM throughput,
#                                     registers, occupancy, cycles per issued instruction
#   bash .ci/gpu_check.sh report      every stage's summary line and the JSON the benchmarks wrote
#   bash .ci/gpu_check.sh all         every stage in turn (each still under its own timeout)
#   bash .ci/gpu_check.sh window [SECONDS] [STAGE...]
#                                     one GPU window of SECONDS in all (default 540): deps, build, the
#                                     STAGEs (default: tests bench memcheck) in turn under the time left,
#                                     report; GPU_WINDOW_OUT=DIR also writes DIR/summary.tsv and
#                                     DIR/gpu-window.tar.gz (every log and benchmark JSON)
#
# Each stage ends with one summary line, "gpu-check STAGE: PASS|FAIL|TIMEOUT in Ns: details", also kept in
# build/gpu-check/summary.tsv for the report; its full output is in build/gpu-check/STAGE.log
# (GPU_CHECK_LOGS names another folder).
# GPU_STAGE_TIMEOUT (seconds, default 525, plus 15 s for a stage that ignores TERM: 540 in all) changes
# the limit; PYTHON the interpreter.
set -uo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")  # re-invoked under the timeout, after the cd
cd "$(dirname "$SELF")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
LOGS=${GPU_CHECK_LOGS:-build/gpu-check}  # the logs and summary.tsv
mkdir -p "$LOGS"
command -v timeout >/dev/null || { echo "gpu-check: needs timeout (coreutils) for its stage limits"; exit 1; }

# The test files that hold GPU cases of the kernels (the sanitizer stage's default).
KERNEL_TEST_FILES=(tests/test_overflow.py tests/test_optim.py tests/test_lamb.py tests/test_lion.py tests/test_scaler.py
                   tests/test_gemm.py tests/test_nn.py tests/test_random.py tests/test_fixed_point.py
                   tests/test_optim_precision.py tests/test_torch_ops.py tests/test_cuda_launches.py)

# A CUDA tool ($1: compute-sanitizer, ncu): the path in $2 (an override: it must work), else on PATH, in
# $CUDA_HOME/bin and the like, beside nvcc, or in an Nsight Compute folder of the toolkit or /opt/nvidia.
find_cuda_tool() {
  local name=$1 override=${2:-}
  if [ -n "$override" ]; then
    if [ -x "$override" ] || command -v "$override" >/dev/null; then echo "$override"; return; fi
    return 1
  fi
  if command -v "$name" >/dev/null; then command -v "$name"; return; fi
  local home nvcc dir
  for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    if [ -n "$home" ] && [ -x "$home/bin/$name" ]; then echo "$home/bin/$name"; return; fi
  done
  if nvcc=$(command -v nvcc); then
    nvcc=$(readlink -f "$nvcc")
    if [ -x "$(dirname "$nvcc")/$name" ]; then echo "$(dirname "$nvcc")/$name"; return; fi
  fi
  for dir in "${CUDA_HOME:-/usr/local/cuda}"/nsight-compute* /opt/nvidia/nsight-compute/*; do
    if [ -x "$dir/$name" ]; then echo "$dir/$name"; return; fi
  done
  return 1
}
find_sanitizer() { find_cuda_tool compute-sanitizer "${COMPUTE_SANITIZER:-}"; }
find_ncu() { find_cuda_tool ncu "${NCU:-}"; }

# "N passed, M skipped in Xs" from a pytest log (its last summary line).
pytest_counts() {
  grep -E "^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected)" "$1" | tail -1 | sed -E 's/=+//g; s/^ +| +$//g'
}

# The CUDA tools and where each is needed: nvcc to build from source (not where a prebuilt extension is
# reused), compute-sanitizer for the sanitize stages (ncu: the profile stage looks for it itself).
find_nvcc() { find_cuda_tool nvcc ""; }
tool_path() {
  case "$1" in
    nvcc) find_nvcc ;;
    compute-sanitizer) find_sanitizer ;;
  esac
}
tool_use() {
  case "$1" in
    nvcc) echo "on PATH or in \$CUDA_HOME/bin; the build stage needs it to build from source" ;;
    compute-sanitizer) echo "on PATH, in \$CUDA_HOME/bin or beside nvcc; the sanitize stages need it" ;;
  esac
}

# What a stage needs, checked in one interpreter run: the Python packages, a CUDA build of torch and a GPU,
# and the CUDA tools named in the arguments (nvcc, compute-sanitizer). Prints "missing: ..." and fails when
# something is absent; every stage runs it first. The deps stage names every tool without requiring one, so
# that a machine without compute-sanitizer (or, with a prebuilt extension, without nvcc) still runs the
# stages that do not need it.
check_deps() {
  local missing=() out tool path
  out=$("$PY" - <<'PYEOF' 2>&1
import importlib, sys
missing = []
if sys.version_info < (3, 9):
    missing.append("python>=3.9")
for name in ("torch", "numpy", "pytest", "hypothesis", "setuptools", "ninja", "rich", "tqdm", "matplotlib"):
    try:
        importlib.import_module(name)
    except Exception:
        missing.append("python package " + name)
try:
    import torch
    if not torch.version.cuda:
        missing.append("a CUDA build of torch (this one has no CUDA)")
    elif not torch.cuda.is_available():
        missing.append("a visible CUDA device")
    else:
        print("torch", torch.__version__, "CUDA", torch.version.cuda, "|", ", ".join(
            f"cuda:{i} {torch.cuda.get_device_name(i)} sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}"
            for i in range(torch.cuda.device_count())))
except Exception:
    pass
for m in missing:
    print("missing:", m)
PYEOF
  ) || missing+=("a working python ($PY)")
  echo "$out"
  while IFS= read -r line; do missing+=("${line#missing: }"); done < <(grep "^missing: " <<<"$out")
  for tool in "$@"; do
    tool_path "$tool" >/dev/null || missing+=("$tool ($(tool_use "$tool"))")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "DETAIL missing: $(IFS=,; echo "${missing[*]}")"
    return 1
  fi
  for tool in nvcc compute-sanitizer; do
    if path=$(tool_path "$tool"); then echo "$tool: $path"; else echo "$tool: not found ($(tool_use "$tool"))"; fi
  done
}

stage_deps() {
  local out absent=()
  out=$(check_deps) || { echo "$out"; return 1; }
  echo "$out"
  while IFS= read -r line; do absent+=("${line%%:*}"); done < <(grep ": not found (" <<<"$out")
  if [ ${#absent[@]} -gt 0 ]; then
    echo "DETAIL the Python packages and the GPU present; not found: ${absent[*]} (the stages that need it will fail)"
  else
    echo "DETAIL all present"
  fi
}

# The key of an extension built for this machine: the sources it is built from, torch's release and commit,
# and Python's extension suffix (its ABI). .ci/gpu_prebuild.sh stores it beside a prebuilt extension; the
# build stage reuses that extension only where its own key is the same.
print_key() {
  "$1" - <<'PYEOF'
import hashlib, pathlib, sysconfig
import torch
files = [p for p in pathlib.Path("csrc").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
files += [pathlib.Path("setup.py"), pathlib.Path("pyproject.toml")]
h = hashlib.sha256()
for p in sorted(files, key=lambda p: p.as_posix()):
    h.update(p.as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
print("sources=" + h.hexdigest())
print("torch=" + torch.__version__)
print("torch_git=" + str(torch.version.git_version))
print("ext_suffix=" + sysconfig.get_config_var("EXT_SUFFIX"))
PYEOF
}

# Puts the extension prebuilt by .ci/gpu_prebuild.sh (GPU_PREBUILT, default build/gpu-prebuilt) in place when
# its key is this machine's and it holds every visible GPU's arch; says why not otherwise.
reuse_prebuilt() {
  local archs=$1 dir=${GPU_PREBUILT:-build/gpu-prebuilt}
  [ -f "$dir/PREBUILT" ] || { echo "no prebuilt extension ($dir/PREBUILT): building from source"; return 1; }
  local have want
  have=$(print_key "$PY") || return 1
  want=$(grep -v "^archs=" "$dir/PREBUILT")
  if [ "$have" != "$want" ]; then
    echo "the prebuilt extension in $dir is not for this machine or these sources: building from source"
    diff <(echo "$want") <(echo "$have") | grep "^[<>]" | sed 's/^</  prebuilt:/; s/^>/  here:    /'
    return 1
  fi
  local built a
  built=$(sed -n 's/^archs=//p' "$dir/PREBUILT")
  for a in ${archs//;/ }; do
    case ";$built;" in
      *";$a;"* | *";$a+PTX;"*) ;;
      *) echo "the prebuilt extension has archs $built, not this GPU's $a: building from source"; return 1 ;;
    esac
  done
  cp "$dir"/_C*.so "$dir"/_build_config.py mpfused/ || return 1
  if ! "$PY" -c "import mpfused, sys; sys.exit(0 if mpfused.has_cuda_kernels() else 1)"; then
    echo "the prebuilt extension does not load here: building from source"
    return 1
  fi
  echo "reusing the extension prebuilt in $dir for $built (torch $(sed -n 's/^torch=//p' <<<"$have"); no nvcc run)"
  PREBUILT_ARCHS=$built
}

stage_build() {
  check_deps > "$LOGS/deps-check.txt" || { cat "$LOGS/deps-check.txt"; return 1; }
  # The archs of the visible GPUs only ("9.0", or "8.0;9.0" on a mixed machine): a fraction of the
  # all-arch build's time.
  local archs
  archs=$("$PY" -c "import torch; print(';'.join(sorted({'%d.%d' % torch.cuda.get_device_capability(i)
                                                          for i in range(torch.cuda.device_count())})))") || return 1
  if [ "${GPU_FORCE_BUILD:-0}" != 1 ] && reuse_prebuilt "$archs"; then
    "$PY" -m mpfused || return 1
    echo "DETAIL reused the prebuilt extension ($PREBUILT_ARCHS): $(ls mpfused/_C*.so)"
    return 0
  fi
  if ! find_nvcc >/dev/null; then
    echo "DETAIL missing: nvcc ($(tool_use nvcc)), and no prebuilt extension for this machine (make gpu-prebuild)"
    return 1
  fi
  echo "building for TORCH_CUDA_ARCH_LIST=$archs with $(nproc) jobs"
  TORCH_CUDA_ARCH_LIST="$archs" MAX_JOBS=$(nproc) "$PY" setup.py -q build_ext --inplace || return 1
  "$PY" -m mpfused || return 1
  "$PY" -c "import mpfused; assert mpfused.has_cuda_kernels(), 'the extension was built without CUDA kernels'" || return 1
  echo "DETAIL built for $archs: $(ls mpfused/_C*.so)"
}

require_build() {
  "$PY" -c "import mpfused, sys; sys.exit(0 if mpfused.has_cuda_kernels() else 1)" 2>/dev/null && return 0
  echo "no CUDA build of mpfused here: run the build stage first (make gpu-check-build)"
  return 1
}

# pytest's options for the GPU cases: -v (a stage stopped at its limit still shows each test that ended),
# the slowest tests (to plan the next window), and where the plugins are installed, several workers on the
# one GPU (GPU_TEST_WORKERS, default half the cores, at most 8; 0 for none) and a limit per test
# (GPU_TEST_TIMEOUT seconds, default 180: a kernel that hangs costs one test, not the window).
pytest_gpu_options() {
  local opts=(-v -p no:cacheprovider --durations=20)
  local workers=${GPU_TEST_WORKERS:-$(( $(nproc) / 2 > 8 ? 8 : $(nproc) / 2 ))}
  if [ "$workers" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then opts+=(-n "$workers"); fi
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    opts+=(--timeout "${GPU_TEST_TIMEOUT:-180}" --timeout-method thread)
  fi
  echo "${opts[@]}"
}

# The Hopper GEMM kernel's cases (-m wgmma) in FILES, in processes of their own, after a canary of each of its
# two forms (one small case of the plain kernel, then of the cluster kernel, each alone, without workers). A
# pipeline that never completes traps only after kMbarWaitLimitCycles (about 70 s, csrc/cuda/wgmma.cuh) and
# leaves its process's CUDA context broken (tests/cuda_context.py then stops that session): every case of that
# form would cost as much, and a window has minutes. So a form whose canary broke the context is not run
# further (the plain one broken: none are, the cluster form falling back to it below 129 rows), and LOG.counts
# says so. Returns 5 where FILES have no wgmma case, 2 when a canary broke the context, 1 when a case failed.
WGMMA_CANARY="itself_runs_aligned_operands and 1-304-264-72-False-False-False"
run_wgmma() {
  local log=$1 opts form crc broken=() select=() rc=0 counts
  shift
  read -r -a opts <<<"$(pytest_gpu_options)"
  for form in wgmma wgmma-cluster; do
    "$PY" -m pytest -v -p no:cacheprovider -p no:xdist -m wgmma -k "$WGMMA_CANARY and cuda-$form-1" "$@" \
      > "$log.canary-$form" 2>&1
    crc=$?
    cat "$log.canary-$form"
    if grep -q -e "CUDA context of its process was broken" -e "the CUDA context is broken" -e "+ Timeout +" \
         "$log.canary-$form"; then
      broken+=("$form")
      echo "run_wgmma: the $form canary broke the CUDA context (a trap, a hang or a fault): its cases are not run"
      break  # (the plain form broken: the cluster form's canary would be refused the same way)
    fi
  done
  case " ${broken[*]} " in
    *" wgmma "*) echo "1 failed (the plain kernel's canary broke the CUDA context; no other case run)" > "$log.counts"
                 return 2 ;;
    *" wgmma-cluster "*) select=(-k "not cluster"); rc=2 ;;
  esac
  "$PY" -m pytest "${opts[@]}" -m wgmma "${select[@]}" "$@" 2>&1 | tee "$log"
  crc=${PIPESTATUS[0]}
  [ "$crc" -eq 5 ] && [ "$rc" -eq 0 ] && return 5
  counts=$(pytest_counts "$log")
  [ "$rc" -eq 2 ] && counts="$counts; the cluster kernel's canary broke the CUDA context: its cases not run"
  echo "$counts" > "$log.counts"
  [ "$rc" -ne 0 ] && return "$rc"
  [ "$crc" -eq 0 ] || return 1
}

stage_tests() {
  check_deps > "$LOGS/deps-check.txt" || { cat "$LOGS/deps-check.txt"; return 1; }
  require_build || return 1
  local log="$LOGS/${LABEL:-tests}.pytest.log" rc=0 counts opts
  read -r -a opts <<<"$(pytest_gpu_options)"
  echo "pytest ${opts[*]}"
  if [ $# -gt 0 ]; then
    "$PY" -m pytest "${opts[@]}" -m "cuda and not wgmma" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    counts=$(pytest_counts "$log")
    # the Hopper GEMM kernel's cases among them, in processes of their own (5: the files have none)
    local wrc
    run_wgmma "$log.wgmma" "$@"
    wrc=$?
    if [ "$wrc" -ne 5 ]; then
      [ "$wrc" -eq 0 ] || rc=1
      counts="$counts; Hopper GEMM kernel: $(cat "$log.wgmma.counts")"
    fi
  else
    # the GPU cases of every file, then the Hopper GEMM kernel's in a process of their own (not yet proven on a
    # GPU: a trap there loses that process's CUDA context, not the other cases'), then the demo, which trains on
    # the GPU whenever there is one
    "$PY" -m pytest "${opts[@]}" -m "cuda and not wgmma" tests 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    counts="cuda cases: $(pytest_counts "$log")"
    local wrc
    run_wgmma "$log.wgmma" tests/test_gemm.py
    wrc=$?
    if [ "$wrc" -ne 0 ]; then
      rc=1
      if [ "$wrc" -eq 1 ]; then
        # where it goes wrong: outputs that name their sources, counted by their place in the tile (not after a
        # canary broke the context: the diagnosis would run the same kernel)
        "$PY" .ci/wgmma_diagnose.py 2>&1 | tee "$LOGS/wgmma-diagnose.log"
        counts="$counts; $(grep "^wgmma diagnosis:" "$LOGS/wgmma-diagnose.log" | tail -1)"
      fi
    fi
    counts="$counts; Hopper GEMM kernel: $(cat "$log.wgmma.counts")"
    "$PY" -m pytest -q -p no:cacheprovider tests/test_demo.py 2>&1 | tee "$log.demo"
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    counts="$counts; demo: $(pytest_counts "$log.demo")"
  fi
  echo "DETAIL $counts"
  return "$rc"
}

stage_sanitize() {
  local tool=${1:-}
  case "$tool" in
    memcheck | racecheck | synccheck | initcheck) shift ;;
    *) echo "sanitize: the first argument must be memcheck, racecheck, synccheck or initcheck, got '${tool}'"; return 2 ;;
  esac
  check_deps compute-sanitizer > "$LOGS/deps-check.txt" || { cat "$LOGS/deps-check.txt"; return 1; }
  require_build || return 1
  local files=("$@") all=${SANITIZE_ALL:-0}
  if [ ${#files[@]} -eq 0 ]; then files=("${KERNEL_TEST_FILES[@]}"); else all=${SANITIZE_ALL:-1}; fi
  local sanitizer
  sanitizer=$(find_sanitizer) || { echo "compute-sanitizer not found"; return 1; }
  # Only mpfused's kernels are instrumented (each lives in namespace mpf: "mpf" is in every name), and
  # torch's caching allocator is off, so that an access past a tensor's end lands outside any allocation
  # (inside a cached block memcheck cannot see it). If this compute-sanitizer refuses the filter, every
  # kernel is instrumented and the log says so.
  # The filter's spelling differs between releases: the first form this one accepts is used (each refusal's
  # first lines are logged). The probe makes one CUDA call: a program that makes none fails under the tool
  # ("terminated before first instrumented API call"), whatever the filter (the H200 run of 2026-11-27).
  local filter=() form why
  for form in "--kernel-name kns=mpf" "--kernel-regex kns=mpf"; do
    # shellcheck disable=SC2086
    if why=$("$sanitizer" $form --tool "$tool" --error-exitcode 1 \
               "$PY" -c "import torch; torch.zeros(1, device='cuda')" 2>&1); then
      read -r -a filter <<<"$form"
      echo "compute-sanitizer filter: $form"
      break
    fi
    echo "compute-sanitizer refused '$form': $(printf '%s\n' "$why" | grep -v '^\s*$' | head -n 2 | tr '\n' ' ')"
  done
  [ ${#filter[@]} -gt 0 ] || echo "no kernel filter accepted: instrumenting every kernel"
  local log="$LOGS/${LABEL:-sanitize-$tool}.pytest.log"
  # Deselected: launch counts seen by the profiler (none under the sanitizer), gigabyte tensors, and the
  # test whose kernel traps on purpose. Over the kernel test files only the cases marked `sanitize` run by
  # default: every kernel on small inputs (the whole files took 7 minutes under memcheck on an H200, past a
  # window's stage); SANITIZE_ALL=1 runs every case. Files named run every case (SANITIZE_ALL=0: the marked
  # ones). The pytest workers are processes of their own, which --target-processes all instruments too; a
  # test may take longer under the tool (600 s each).
  local subset="sanitize and " scope="the sanitize cases"
  if [ "$all" = 1 ]; then subset="" scope="every case"; fi
  local opts
  read -r -a opts <<<"$(GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-600} pytest_gpu_options)"
  echo "pytest ${opts[*]} ($scope)"
  local deselect="not profiler and not big and not trap"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" ${filter[@]+"${filter[@]}"} --error-exitcode 1 \
    --target-processes all "$PY" -m pytest "${opts[@]}" -m "cuda and ${subset}${deselect} and not wgmma" \
    "${files[@]}" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 5 ]; then  # pytest's "no tests collected": these files hold no such cases
    echo "none of ${files[*]} holds a GPU case of this selection ($scope)"
    rc=0
  fi
  # The Hopper GEMM kernel's cases among them, in a process of their own as in the test stage (pytest's 5:
  # the files hold none; on a GPU without the kernel they are skipped)
  local wrc wcounts="" wsel=""
  # (a form whose canary broke the CUDA context in the test stage (run_wgmma) is left out here too)
  if grep -qs "plain kernel's canary broke" "$LOGS"/tests*.pytest.log.wgmma.counts; then
    wsel=" and not wgmma" wcounts="; Hopper GEMM kernel: not run (its canary broke the CUDA context in the test stage)"
  elif grep -qs "cluster kernel's canary broke" "$LOGS"/tests*.pytest.log.wgmma.counts; then
    wsel=" and not cluster"
  fi
  : > "$log.wgmma"
  if [ -z "$wcounts" ]; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" ${filter[@]+"${filter[@]}"} --error-exitcode 1 \
      --target-processes all "$PY" -m pytest "${opts[@]}" -m "wgmma and ${subset}${deselect}" \
      ${wsel:+-k "${wsel# and }"} "${files[@]}" 2>&1 | tee "$log.wgmma"
    wrc=${PIPESTATUS[0]}
    if [ "$wrc" -ne 5 ]; then
      [ "$wrc" -eq 0 ] || rc=1
      wcounts="; Hopper GEMM kernel: $(pytest_counts "$log.wgmma")${wsel:+ (the cluster form left out: its canary broke the context)}"
    fi
  fi
  local errors
  errors=$(cat "$log" "$log.wgmma" | grep -Eo "ERROR SUMMARY: [0-9]+ error" | awk '{s += $3} END {print s + 0}')
  echo "DETAIL $tool over ${#files[@]} file(s), $scope: $(pytest_counts "$log")$wcounts; sanitizer errors: $errors"
  return "$rc"
}

stage_bench() {
  check_deps > "$LOGS/deps-check.txt" || { cat "$LOGS/deps-check.txt"; return 1; }
  require_build || return 1
  local names=("$@") failed=0 done_list=()
  if [ ${#names[@]} -eq 0 ]; then
    for b in benchmarks/bench_*.py; do names+=("$(basename "$b" .py)"); done
  fi
  local name
  for name in "${names[@]}"; do
    # as modules of the benchmarks package, from the root (the in-place build); short repetition mode
    echo "== benchmarks.$name"
    if "$PY" -m "benchmarks.$name" --device cuda --json --max-seconds "${BENCH_MAX_SECONDS:-0.5}"; then
      done_list+=("$name")
    else
      echo "benchmarks.$name FAILED"
      failed=1
    fi
  done
  echo "DETAIL ran: ${done_list[*]:-none}; JSON: $(ls benchmarks/results/*_cuda_*.json 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')"
  return "$failed"
}

# Issue 13's CPU goals on the GPU machine's own cores (16 on the machines lent so far): on the 2-core VMs the
# optimizer step and the rounding are bound by the cores' arithmetic, so the stochastic / nearest ratio there
# is the generator's cost; with more cores than the memory needs, the step is bound by memory, as on a GPU.
# The stochastic-rounding sections of bench_optim, bench_random and bench_fixed_point with --device cpu, JSON
# named after the CPU path and the core count (benchmarks/results/<name>_cpu_<isa>_<N>cpus.json).
stage_bench_cpu() {
  check_deps > "$LOGS/deps-check.txt" || { cat "$LOGS/deps-check.txt"; return 1; }
  require_build || return 1
  local isa n failed=0 done_list=() spec name
  isa=$("$PY" -c "import mpfused; print(mpfused.build_info()['cpu_isa'])") || return 1
  n=$(nproc)
  for spec in "bench_optim --sections sr-fp16 sr-bf16" "bench_random" "bench_fixed_point"; do
    name=${spec%% *}
    echo "== benchmarks.$name on the CPU ($isa, $n cpus)"
    # shellcheck disable=SC2086
    if "$PY" -m "benchmarks.$name" --device cpu ${spec#"$name"} --max-seconds "${BENCH_MAX_SECONDS:-0.5}" \
         --json "benchmarks/results/${name}_cpu_${isa}_${n}cpus.json"; then
      done_list+=("$name")
    else
      echo "benchmarks.$name FAILED"
      failed=1
    fi
  done
  echo "DETAIL ran on $n cpus ($isa): ${done_list[*]:-none}"
  return "$failed"
}

# Nsight Compute over the workloads of benchmarks/profile_kernels.py (the kernels behind the missed goals),
# one process each: the first launch of the workload's kernel, with the sections of profile_kernels.SECTIONS,
# as CSV in $LOGS/profile-WORKLOAD.csv; then one table of them ($LOGS/profile.tsv, profile.json).
stage_profile() {
  check_deps > "$LOGS/deps-check.txt" || { cat "$LOGS/deps-check.txt"; return 1; }
  require_build || return 1
  local ncu
  ncu=$(find_ncu) || { echo "ncu (Nsight Compute) not found: set NCU=/path/to/ncu"; return 1; }
  local list
  list=$("$PY" -m benchmarks.profile_kernels list) || return 1
  local names=("$@")
  [ ${#names[@]} -gt 0 ] || mapfile -t names < <(printf '%s\n' "$list" | cut -f1)
  local sections=() s names_of_sections
  names_of_sections=$("$PY" -c "from benchmarks.profile_kernels import SECTIONS; print(' '.join(SECTIONS))") || return 1
  for s in $names_of_sections; do sections+=(--section "$s"); done
  [ ${#sections[@]} -gt 0 ] || { echo "profile: no ncu sections named"; return 1; }
  local name kernel csvs=() failed=0
  for name in "${names[@]}"; do
    kernel=$(printf '%s\n' "$list" | awk -F'\t' -v n="$name" '$1 == n {print $2}')
    if [ -z "$kernel" ]; then echo "profile: unknown workload '$name'"; failed=1; continue; fi
    local why
    why=$(printf '%s\n' "$list" | awk -F'\t' -v n="$name" '$1 == n {print $4}')
    if [ -n "$why" ]; then echo "== $name: not run here ($why)"; continue; fi
    echo "== $name (kernel $kernel)"
    local out="$LOGS/profile-$name.csv"
    # base units (ns, bytes): the rows of every workload compare as they are
    "$ncu" --target-processes all --kernel-name "regex:$kernel" --launch-count 1 "${sections[@]}" --csv \
      --page details --print-units base --log-file "$out" "$PY" -m benchmarks.profile_kernels run "$name" || failed=1
    grep -m 3 "==ERROR==\|==WARNING==" "$out" || true
    csvs+=("$out")
  done
  [ ${#csvs[@]} -gt 0 ] || return 1
  "$PY" -m benchmarks.profile_kernels summarize "${csvs[@]}" --json "$LOGS/profile.json" | tee "$LOGS/profile.tsv"
  [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
  local profiled
  profiled=$(grep -l '^"ID",' "${csvs[@]}" 2>/dev/null | wc -l)
  echo "DETAIL ncu profiled ${profiled} of ${#csvs[@]} workload(s): $LOGS/profile.tsv"
  return "$failed"
}

stage_report() {
  echo "== summary of the stages run (build/gpu-check/summary.tsv)"
  if [ -f "$LOGS/summary.tsv" ]; then
    column -t -s $'\t' "$LOGS/summary.tsv" 2>/dev/null || cat "$LOGS/summary.tsv"
  else
    echo "(no stage has run yet)"
  fi
  echo "== benchmark JSON written on this GPU"
  ls -l benchmarks/results/*_cuda_*.json 2>/dev/null || echo "(none)"
  local failed
  failed=$(awk -F'\t' '$2 != "PASS"' "$LOGS/summary.tsv" 2>/dev/null | grep -vc "^report" || true)
  echo "DETAIL stages not passed: ${failed:-0}"
  [ "${failed:-0}" -eq 0 ]
}

run_stage() {  # inside the timeout
  local stage=$1
  shift
  case "$stage" in
    deps) stage_deps ;;
    build) stage_build ;;
    tests) stage_tests "$@" ;;
    sanitize) stage_sanitize "$@" ;;
    bench) stage_bench "$@" ;;
    bench-cpu) stage_bench_cpu ;;
    profile) stage_profile "$@" ;;
    report) stage_report ;;
    *) echo "unknown stage '$stage': deps, build, tests [FILE...], sanitize TOOL [FILE...], bench [NAME...], bench-cpu, profile [WORKLOAD...], report, all"; return 2 ;;
  esac
}

if [ "${1:-}" = "--inner" ]; then
  shift
  run_stage "$@"
  exit $?
fi
if [ "${1:-}" = "--key" ]; then  # for .ci/gpu_prebuild.sh: the key of a build by the interpreter $2
  print_key "${2:-$PY}"
  exit $?
fi
if [ "${1:-}" = "--wgmma" ]; then  # run_wgmma alone: LOG FILE... (for its test, with a stand-in interpreter)
  shift
  run_wgmma "$@"
  exit $?
fi
if [ "${1:-}" = "--reuse" ]; then  # the build stage's reuse of a prebuilt extension alone, for ARCHS ($2)
  reuse_prebuilt "${2:?--reuse needs the archs, e.g. 9.0}"
  exit $?
fi

# A stage's label: its name, the sanitizer's tool, and the files or benchmarks it was given (so that a
# stage split over several runs keeps one summary line per part).
stage_label() {
  local label=$1
  shift
  if [ "$label" = sanitize ]; then label="sanitize-${1:-}"; shift; fi
  local part
  for part in "$@"; do
    part=$(basename "$part" .py)
    part=${part#test_}
    label="$label-${part#bench_}"
  done
  echo "$label"
}

stage_with_timeout() {
  # -k 15: a stage that ignores the TERM at the limit is killed 15 s later, within the 9-minute window
  local label
  label=$(stage_label "$@")
  local log="$LOGS/$label.log" limit=${GPU_STAGE_TIMEOUT:-525} start=$SECONDS
  LABEL=$label timeout -k 15 "$limit" bash "$SELF" --inner "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]} status=PASS
  [ "$rc" -eq 0 ] || status=FAIL
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status=TIMEOUT
  local detail
  detail=$(grep "^DETAIL " "$log" | tail -1 | cut -c8-)
  [ "$status" = TIMEOUT ] && detail="stopped after ${limit}s; ${detail:-no summary}"
  local line="gpu-check $label: $status in $((SECONDS - start))s: ${detail:-see $log}"
  echo "$line"
  if [ -f "$LOGS/summary.tsv" ]; then  # the stage's previous line is replaced
    { grep -v "^$label"$'\t' "$LOGS/summary.tsv" || true; } > "$LOGS/summary.tsv.new"
    mv "$LOGS/summary.tsv.new" "$LOGS/summary.tsv"
  fi
  printf '%s\t%s\t%ss\t%s\n' "$label" "$status" "$((SECONDS - start))" "${detail:-}" >> "$LOGS/summary.tsv"
  return "$rc"
}

case "${1:-all}" in
  all)
    rc=0
    stage_with_timeout deps || exit 1
    stage_with_timeout build || exit 1
    stage_with_timeout tests || rc=1
    for tool in memcheck racecheck synccheck initcheck; do stage_with_timeout sanitize "$tool" || rc=1; done
    stage_with_timeout bench || rc=1
    stage_with_timeout profile || rc=1
    stage_with_timeout report || rc=1
    exit "$rc"
    ;;
  window)
    # One GPU window of SECONDS (default 540) in all: deps, the build (the prebuilt extension where it
    # matches), then the stages named (default: tests bench memcheck) in that order, each under the time the
    # window has left (tests at most WINDOW_TESTS_SECONDS, 300 by default; the benchmarks
    # WINDOW_BENCH_SECONDS, 150), then the report. With GPU_WINDOW_OUT, the summary and one archive of every
    # log and benchmark JSON are written there (a folder that comes back from the GPU machine).
    shift
    budget=540
    if [[ "${1:-}" =~ ^[0-9]+$ ]]; then budget=$1; shift; fi
    plan=("$@")
    [ ${#plan[@]} -gt 0 ] || plan=(tests bench memcheck)
    for s in "${plan[@]}"; do
      case "$s" in
        tests | bench | bench-cpu | profile | memcheck | racecheck | synccheck | initcheck) ;;
        *) echo "window: unknown stage '$s' (tests, bench, bench-cpu, profile, memcheck, racecheck, synccheck, initcheck)"; exit 2 ;;
      esac
    done
    deadline=$((SECONDS + budget))
    # a stage gets the window's time left, less 15 s (the kill after TERM) and 20 s (the report), at most CAP
    within() {
      local cap=$1 left
      shift
      left=$((deadline - SECONDS - 35))
      if [ "$left" -lt 20 ]; then  # (a row of its own, so that the report counts it as not passed)
        local label
        label=$(stage_label "$@")
        echo "gpu-check $label: SKIPPED: no time left in the window"
        printf '%s\tSKIPPED\t0s\tno time left in the window\n' "$label" >> "$LOGS/summary.tsv"
        return 1
      fi
      if [ "$cap" -gt 0 ] && [ "$cap" -lt "$left" ]; then left=$cap; fi
      GPU_STAGE_TIMEOUT=$left stage_with_timeout "$@"
    }
    rc=0
    rm -f "$LOGS/summary.tsv"
    within 60 deps && within 0 build || rc=1
    if [ "$rc" -eq 0 ]; then
      for s in "${plan[@]}"; do
        case "$s" in
          tests) within "${WINDOW_TESTS_SECONDS:-300}" tests || rc=1 ;;
          # the benchmarks that hold the goals first
          bench) BENCH_MAX_SECONDS=${BENCH_MAX_SECONDS:-0.3} within "${WINDOW_BENCH_SECONDS:-150}" bench \
                   bench_optim bench_overflow bench_scaler bench_gemm bench_random bench_fixed_point || rc=1 ;;
          profile) within 0 profile || rc=1 ;;
          bench-cpu) BENCH_MAX_SECONDS=${BENCH_MAX_SECONDS:-0.3} within 0 bench-cpu || rc=1 ;;
          *) within 0 sanitize "$s" || rc=1 ;;
        esac
      done
    fi
    stage_with_timeout report || rc=1
    if [ -n "${GPU_WINDOW_OUT:-}" ]; then
      mkdir -p "$GPU_WINDOW_OUT"
      cp "$LOGS/summary.tsv" "$GPU_WINDOW_OUT/summary.tsv" 2>/dev/null || true
      mkdir -p "$LOGS/bench-json"
      cp benchmarks/results/*_cuda_*.json benchmarks/results/*cpus.json "$LOGS/bench-json/" 2>/dev/null || true
      tar -czf "$GPU_WINDOW_OUT/gpu-window.tar.gz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" || rc=1
      echo "gpu-check window: $GPU_WINDOW_OUT/summary.tsv and gpu-window.tar.gz ($(du -h "$GPU_WINDOW_OUT/gpu-window.tar.gz" | cut -f1))"
    fi
    exit "$rc"
    ;;
  *) stage_with_timeout "$@" ;;
esac
