# mpfused: the commands that work on a fresh machine.
#   make test   create .venv, install torch if missing, build, run pytest and the native tests (the CUDA
#               simulator's included: csrc/cuda's kernels run on the CPU; make test-cuda-sim runs it alone)
#   make test-integrations   install the pinned framework packages (torch kept as it is) and run
#               tests/integrations: Lightning, accelerate, the Hugging Face Trainer
#   make demo   the main job
#   make cuda-check   the CUDA checks that need no GPU (compile for every arch, SASS, CUDA install path)
#   make gpu-check    on a machine with a GPU: build, CUDA tests, compute-sanitizer, benchmarks -> JSON, report;
#               each stage alone: make gpu-check-<deps|build|tests|sanitize-TOOL|bench|report>
#   make gpu-prebuild   here, without a GPU: the extension for the GPU machine (build/gpu-prebuilt/)
#   make gpu-window     on the GPU machine: one window of WINDOW_SECONDS through the stages, in priority order

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The torch that `make test` installs when the venv has none. A CPU build is enough for the tests.
TORCH_SPEC ?= torch==2.13.0
DEV_PACKAGES := numpy pytest pytest-xdist hypothesis ninja 'setuptools>=77' wheel rich tqdm matplotlib scikit-learn
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
# pytest's worker processes (pytest-xdist) for the full suite: one test process alone keeps about 1.2 of 2 cores
# busy (the tests are mostly small and host-bound), so `make test` runs JOBS of them (tests/conftest.py gives each
# its share of the threads). PYTEST_WORKERS=0 runs in one process. The shorter kernel-test runs per CPU path stay
# in one process: two workers' start-up costs more than they save there (measured: 17 s alone, 18 s with two).
PYTEST_WORKERS ?= $(JOBS)
NATIVE_BUILD := build/native
CUDA_BUILD := build/cuda-check

.PHONY: venv build test test-python test-native test-cuda-sim test-integrations isa-check demo bench cuda-compile sass-check cuda-install-check cuda-check \
        gpu-check gpu-check-deps gpu-check-build gpu-check-tests gpu-check-report gpu-check-bench gpu-check-bench-cpu gpu-check-profile \
        gpu-check-sanitize-memcheck gpu-check-sanitize-racecheck gpu-check-sanitize-synccheck gpu-check-sanitize-initcheck \
        gpu-prebuild gpu-window clean

$(VENV)/.ready:
	$(PYTHON) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install --progress-bar off "$(TORCH_SPEC)"
	$(VPY) -m pip install --progress-bar off -q $(DEV_PACKAGES)
	touch $@

venv: $(VENV)/.ready

# In-place build: the extension lands in mpfused/ and ninja rebuilds only what changed (build/temp*).
build: venv
	MAX_JOBS=$(JOBS) $(VPY) setup.py -q build_ext --inplace
	$(VPY) -m mpfused

# The CPU kernel tests run again under every other CPU path this machine supports (MPFUSED_CPU_ISA);
# the paths it lacks are listed as skipped. tests/test_cpu_isa.py compares the paths bit for bit.
ISA_PATHS := scalar avx2 avx512
KERNEL_TESTS := tests/test_overflow.py tests/test_optim.py tests/test_lamb.py tests/test_lion.py tests/test_gemm.py tests/test_random.py \
                tests/test_fixed_point.py tests/test_optim_precision.py
SUPPORTED_ISAS = $(shell $(VPY) -c "import mpfused; print(mpfused.build_info()['cpu_isa_supported'].replace(',', ''))")
DEFAULT_ISA = $(shell $(VPY) -c "import mpfused; print(mpfused.build_info()['cpu_isa'])")

test-python: build
	@$(VPY) -c "import xdist" 2>/dev/null || $(VPY) -m pip install --progress-bar off -q pytest-xdist
	$(VPY) -m pytest -q -n $(PYTEST_WORKERS)
	@supported="$(SUPPORTED_ISAS)"; default="$(DEFAULT_ISA)"; echo "CPU path $$default: full suite ran above"; \
	for isa in $(ISA_PATHS); do \
	  case " $$supported " in *" $$isa "*) ;; *) echo "CPU path $$isa: SKIPPED (this CPU lacks it)"; continue;; esac; \
	  [ "$$isa" = "$$default" ] && continue; \
	  echo "CPU path $$isa: kernel tests"; \
	  MPFUSED_CPU_ISA=$$isa $(VPY) -m pytest -q $(KERNEL_TESTS) || exit 1; \
	done

# The native tests link the CPU objects the build just made (setup.py lists them in build/cpu-objects.txt;
# CMakeLists.txt says what it checks instead of compiling them again); without that list, CMake compiles them.
test-native: build
	cmake -S . -B $(NATIVE_BUILD) -DCMAKE_BUILD_TYPE=Release -DMPFUSED_CUDA=OFF "-DMPFUSED_CPU_OBJECTS=$$(cat build/cpu-objects.txt 2>/dev/null)"
	cmake --build $(NATIVE_BUILD) -j $(JOBS)
	@supported="$(SUPPORTED_ISAS)"; \
	for isa in $(ISA_PATHS); do \
	  case " $$supported " in *" $$isa "*) ;; *) echo "CPU path $$isa: native tests SKIPPED (this CPU lacks it)"; continue;; esac; \
	  echo "CPU path $$isa: native tests"; \
	  MPFUSED_CPU_ISA=$$isa ctest --test-dir $(NATIVE_BUILD) --output-on-failure -LE cuda_sim || exit 1; \
	done
	@echo "CUDA simulator: csrc/cuda's kernels on the CPU (AddressSanitizer + UBSan, sm_75, ThreadSanitizer)"
	ctest --test-dir $(NATIVE_BUILD) --output-on-failure -L cuda_sim -j $(JOBS)

# The CUDA simulator's tests alone (tests/native/cuda_sim): what test-native runs after the native tests.
test-cuda-sim: build
	cmake -S . -B $(NATIVE_BUILD) -DCMAKE_BUILD_TYPE=Release -DMPFUSED_CUDA=OFF "-DMPFUSED_CPU_OBJECTS=$$(cat build/cpu-objects.txt 2>/dev/null)"
	cmake --build $(NATIVE_BUILD) -j $(JOBS) --target test_cuda_sim_asan test_cuda_sim_sm75 test_cuda_sim_tsan
	ctest --test-dir $(NATIVE_BUILD) --output-on-failure -L cuda_sim -j $(JOBS)

# The avx512 clones use 512-bit vectors (read from the machine code; no AVX-512 hardware needed).
isa-check: build
	$(VPY) .ci/check_isa_clones.py

test: test-python test-native

# The framework integrations (mpfused/integrations/, tests/integrations/), with the versions they are tested
# with. pip gets the venv's torch as a constraint, so it never replaces it. A package that cannot be
# installed (no index, no wheel for this Python) is reported and its tests are skipped with the reason.
INTEGRATION_PACKAGES := lightning==2.6.6 accelerate==1.15.0 transformers==5.24.0
INTEGRATION_CONSTRAINTS := build/integration-constraints.txt

test-integrations: build
	@mkdir -p build
	$(VPY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(INTEGRATION_CONSTRAINTS)
	@$(VPY) -m pip install --progress-bar off -q -c $(INTEGRATION_CONSTRAINTS) $(INTEGRATION_PACKAGES) || \
	for pkg in $(INTEGRATION_PACKAGES); do \
	  $(VPY) -m pip install --progress-bar off -q -c $(INTEGRATION_CONSTRAINTS) "$$pkg" || \
	    echo "test-integrations: $$pkg could not be installed; the tests that need it are skipped"; \
	done
	HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(VPY) -m pytest -q -p no:cacheprovider tests/integrations

# The demo is a script outside the package (matplotlib is its dependency, not mpfused's); PYTHONPATH=.
# finds the in-place build.
demo: build
	PYTHONPATH=. $(VPY) examples/demo.py

# benchmarks/ is a package run from the repository root, which puts the in-place build on the path. Each
# writes its JSON under benchmarks/results/ (<name>_cpu_<CPU path>.json, <name>_cuda_<GPU>.json);
# BENCH_ARGS is passed to every one (e.g. BENCH_ARGS=--quick).
BENCHMARKS := $(basename $(notdir $(wildcard benchmarks/bench_*.py)))
BENCH_ARGS ?=
bench: build
	for b in $(BENCHMARKS); do $(VPY) -m benchmarks.$$b --json $(BENCH_ARGS) || exit 1; done

# ---- CUDA checks that need no GPU -----------------------------------------------------------------
# The archs, passed every time (a build directory's cache would keep an older default); 90a: compute capability
# 9.0 as setup.py builds it, with the Hopper GEMM's warpgroup MMAs.
CUDA_ARCHS ?= 75;80;86;89;90a
cuda-compile:
	cmake -S . -B $(CUDA_BUILD) -DCMAKE_BUILD_TYPE=Release -DMPFUSED_CUDA=ON -DMPFUSED_NATIVE_TESTS=OFF "-DMPFUSED_CUDA_ARCHS=$(CUDA_ARCHS)"
	cmake --build $(CUDA_BUILD) -j $(JOBS) --target mpfused_cuda_kernels

sass-check: cuda-compile venv
	$(VPY) -m pip install --progress-bar off -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
	$(VPY) .ci/check_sass.py $(CUDA_BUILD)/libmpfused_cuda_kernels.so

cuda-install-check:
	bash .ci/cuda_install_check.sh

cuda-check: sass-check cuda-install-check

# ---- on a machine with a GPU (its torch already has CUDA; nothing is downloaded) ------------------
# Each stage fits a 9-minute GPU window (timeout 540 inside) and ends with a summary line; the build stage
# leaves mpfused/_C*.so and build/ for the others. `make gpu-check` runs them all in turn.
#   make gpu-check-sanitize-memcheck FILES="tests/test_gemm.py"   one tool over every GPU case of some test files
#   make gpu-check-tests FILES="tests/test_optim.py"               the GPU cases of some test files
#   make gpu-check-bench BENCH="bench_optim bench_gemm"            some benchmarks
#   make gpu-check-profile WORKLOADS="adamw-fp16-stochastic"        ncu over some kernels (profile_kernels.py)
SANITIZERS := memcheck racecheck synccheck initcheck
gpu-check:
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh all

gpu-check-deps gpu-check-build gpu-check-report gpu-check-bench-cpu:
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh $(patsubst gpu-check-%,%,$@)

gpu-check-tests:
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh tests $(FILES)

$(addprefix gpu-check-sanitize-,$(SANITIZERS)):
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh sanitize $(patsubst gpu-check-sanitize-%,%,$@) $(FILES)

gpu-check-bench:
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh bench $(BENCH)

gpu-check-profile:
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh profile $(WORKLOADS)

# A GPU window is short (15 minutes of device time, the machine's start included): the extension is built
# beforehand, here, for the GPU machine's Python, torch and arch (GPU_PYTHON, GPU_TORCH_SPEC, GPU_ARCHS;
# .ci/gpu_prebuild.sh), and travels to it in build/gpu-prebuilt/; its build stage reuses it where the key
# (sources, torch, Python) is its own, and builds from source otherwise.
gpu-prebuild:
	bash .ci/gpu_prebuild.sh

# On the GPU machine: deps, build (or the prebuilt one), then WINDOW_STAGES in turn, all within
# WINDOW_SECONDS; GPU_WINDOW_OUT=DIR gets the summary and an archive of every log and JSON.
WINDOW_SECONDS ?= 540
WINDOW_STAGES ?= tests bench memcheck
gpu-window:
	PYTHON=$(PYTHON) bash .ci/gpu_check.sh window $(WINDOW_SECONDS) $(WINDOW_STAGES)

clean:
	rm -rf build mpfused/_C*.so mpfused/_build_config.py *.egg-info
