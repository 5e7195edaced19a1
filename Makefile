# mpfused: the commands that work on a fresh machine.
#   make test   create .venv, install torch if missing, build, run pytest and the native tests
#   make demo   the main job
#   make cuda-check   the CUDA checks that need no GPU (compile for every arch, SASS, CUDA install path)
#   make gpu-check    on a machine with a GPU: CUDA tests, compute-sanitizer, benchmarks -> JSON

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# The torch that `make test` installs when the venv has none. A CPU build is enough for the tests.
TORCH_SPEC ?= torch==2.13.0
DEV_PACKAGES := numpy pytest hypothesis ninja setuptools wheel rich tqdm matplotlib
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
NATIVE_BUILD := build/native
CUDA_BUILD := build/cuda-check

.PHONY: venv build test test-python test-native demo bench cuda-compile sass-check cuda-install-check cuda-check gpu-check clean

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

test-python: build
	$(VPY) -m pytest -q

test-native:
	cmake -S . -B $(NATIVE_BUILD) -DCMAKE_BUILD_TYPE=Release -DMPFUSED_CUDA=OFF
	cmake --build $(NATIVE_BUILD) -j $(JOBS)
	ctest --test-dir $(NATIVE_BUILD) --output-on-failure

test: test-python test-native

demo: build
	$(VPY) -m mpfused.demo

bench: build
	for b in benchmarks/bench_*.py; do PYTHONPATH=. $(VPY) $$b || exit 1; done

# ---- CUDA checks that need no GPU -----------------------------------------------------------------
cuda-compile:
	cmake -S . -B $(CUDA_BUILD) -DCMAKE_BUILD_TYPE=Release -DMPFUSED_CUDA=ON -DMPFUSED_NATIVE_TESTS=OFF
	cmake --build $(CUDA_BUILD) -j $(JOBS)

sass-check: cuda-compile venv
	$(VPY) -m pip install --progress-bar off -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
	$(VPY) .ci/check_sass.py $(CUDA_BUILD)/libmpfused_cuda_kernels.so

cuda-install-check:
	bash .ci/cuda_install_check.sh

cuda-check: sass-check cuda-install-check

# ---- on a machine with a GPU (its torch already has CUDA; nothing is downloaded) ------------------
gpu-check:
	bash .ci/gpu_check.sh

clean:
	rm -rf build mpfused/_C*.so mpfused/_build_config.py *.egg-info
