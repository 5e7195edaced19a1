"""Builds mpfused._C.

- CUDA-enabled torch and nvcc found (CUDA_HOME or nvcc on PATH): a CUDAExtension with the CPU and the
  CUDA kernels, for the archs in TORCH_CUDA_ARCH_LIST (default below).
- CPU-only torch, no nvcc, or MPFUSED_FORCE_CPU=1: the same module with the CPU kernels only.

Install with `pip install --no-build-isolation .` so that the extension is built against the torch
already installed (build isolation would fetch a different one).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "7.5;8.0;8.6;8.9;9.0+PTX"  # CUDA 13 has no sm_70; PTX for 9.0 JIT-compiles on newer GPUs

def locate_cuda_home() -> None:
    """torch guesses the CUDA toolkit from the location of `nvcc` on PATH, which is wrong when that is
    a wrapper script (e.g. /usr/local/bin/nvcc -> /usr/local/cuda-13.0/bin/nvcc gives /usr/local).
    Ask nvcc itself where its toolkit is, before torch.utils.cpp_extension reads CUDA_HOME."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return
    try:
        out = subprocess.run([nvcc, "--dryrun", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return
    m = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.M)
    top = Path(m.group(1).strip()).resolve() if m else Path(nvcc).resolve().parent.parent
    if (top / "include" / "cuda_runtime.h").exists() or (top / "targets").exists():
        os.environ["CUDA_HOME"] = str(top)


def setuptools_problem(version: str) -> str:
    """A message where this setuptools cannot build mpfused, else "". pyproject.toml's `license` is an SPDX
    expression, which setuptools reads from 77.0 on; from 61.0 (which reads pyproject.toml's [project] table) to
    76 it stops at pyproject.toml with a schema error that names no version (Python 3.11's venvs start with
    65.5). Older ones ignore that table, and `setup.py build_ext` still works with them. With
    --no-build-isolation the setuptools of the environment builds, whatever build-system.requires asks for."""
    m = re.match(r"(\d+)", version)
    if not m or not 61 <= int(m.group(1)) < 77:
        return ""
    return (f"mpfused: setuptools {version} is too old to build mpfused (pyproject.toml's license is an SPDX "
            "expression, read by setuptools 77.0 and newer): pip install -U 'setuptools>=77', then build again "
            "with --no-build-isolation")


def check_setuptools() -> None:
    import setuptools

    message = setuptools_problem(setuptools.__version__)
    if message:
        sys.exit(message)


check_setuptools()
locate_cuda_home()

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - message for users only
    sys.exit(
        "mpfused needs torch installed before it is built: pip install torch, then "
        "pip install --no-build-isolation ."
    )

OLDEST_TORCH = (2, 9)  # pyproject.toml's dependency, the oldest torch tried (README, "Install")


def torch_problem(version: str) -> str:
    """A message where the installed torch is older than pyproject.toml asks for, else "". Built against it, the
    extension would not load after pip, resolving the dependency, installed a newer torch beside it."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m or (int(m.group(1)), int(m.group(2))) >= OLDEST_TORCH:
        return ""
    return (f"mpfused: torch {version} is older than {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}, the oldest it supports: "
            f"pip install 'torch>={OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}', then build again with --no-build-isolation")


if torch_problem(torch.__version__):
    sys.exit(torch_problem(torch.__version__))


def read_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version\s*=\s*"([^"]+)"', text, re.M).group(1)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def openmp_flags() -> list:
    # gcc and clang on Linux: -fopenmp. torch ships libgomp.so.1, which the loader then shares.
    return ["-fopenmp"] if sys.platform.startswith("linux") else []


def cuda_toolkit_problem(nvcc_version: str, torch_cuda: str) -> tuple:
    """Whether the nvcc that would compile the kernels suits the CUDA that torch was built with:
    ("", "") when they agree, ("error", message) when their major versions differ (the extension would
    not load, or would fail at its first launch), ("note", message) when only the minor versions differ
    (CUDA's minor version compatibility: it builds and runs). Versions as "major.minor"."""
    n, t = (tuple(int(x) for x in v.split(".")[:2]) for v in (nvcc_version, torch_cuda))
    if n == t:
        return "", ""
    if n[0] != t[0]:
        return "error", (
            f"mpfused: nvcc is CUDA {nvcc_version} but torch {torch.__version__} was built with CUDA {torch_cuda}; "
            f"the CUDA kernels must be compiled by a toolkit of the same major version ({t[0]}.x). Either point "
            f"CUDA_HOME at a CUDA {t[0]}.x toolkit (with its nvcc), or install a torch built for CUDA {n[0]}.x "
            "(the CUDA variants and their pip commands: https://pytorch.org/get-started/locally/), or build "
            "without the CUDA kernels: MPFUSED_FORCE_CPU=1.")
    return "note", (f"mpfused: nvcc is CUDA {nvcc_version}, torch was built with CUDA {torch_cuda}: the same major "
                    "version, which CUDA's minor version compatibility allows")


def nvcc_version(cuda_home: str) -> str:
    """The "major.minor" release of $CUDA_HOME/bin/nvcc; exits with the reason when it cannot be run."""
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        sys.exit(f"mpfused: could not run {nvcc} --version ({e}); set CUDA_HOME to a CUDA toolkit, or "
                 "MPFUSED_FORCE_CPU=1 for a CPU-only build")
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        sys.exit(f"mpfused: {nvcc} --version printed no release number: {out.strip()[:200]!r}")
    return m.group(1)


def use_cuda() -> bool:
    if env_flag("MPFUSED_FORCE_CPU"):
        print("mpfused: MPFUSED_FORCE_CPU is set: building the CPU-only extension")
        return False
    if torch.version.cuda is None:
        print(f"mpfused: torch {torch.__version__} has no CUDA: building the CPU-only extension")
        return False
    if cpp_extension.CUDA_HOME is None:
        print("mpfused: no nvcc found (set CUDA_HOME or put nvcc on PATH): building the CPU-only extension")
        return False
    level, message = cuda_toolkit_problem(nvcc_version(cpp_extension.CUDA_HOME), torch.version.cuda)
    if level == "error":
        sys.exit(message)
    if message:
        print(message)
    return True


def gencode_flags(arch_list: str, sm90a_ok: bool = True) -> tuple[list[str], bool]:
    """nvcc's -gencode flags for a TORCH_CUDA_ARCH_LIST ("7.5;8.0;9.0+PTX": machine code for each, PTX for
    the "+PTX" ones), and whether they hold sm_90a code. Compute capability 9.0's machine code is built for
    sm_90a, the arch-specific target whose warpgroup MMAs the Hopper GEMM kernel uses (it runs on 9.0 GPUs
    only, as sm_90 code does); its PTX stays compute_90, which newer GPUs can compile. sm90a_ok False (an nvcc
    older than CUDA 12.0, which has no sm_90a): plain sm_90, without the Hopper kernel. A list that names
    arches by name ("Hopper", "native", as torch accepts them) gives no flags: torch makes them, without sm_90a."""
    arch_entry = re.compile(r"(\d+)\.(\d+)(a?)(\+PTX)?")
    entries = [e for e in (e.strip() for e in arch_list.replace(",", ";").replace(" ", ";").split(";")) if e]
    if entries and all(re.fullmatch(r"[A-Za-z][A-Za-z+]*", e) for e in entries if not arch_entry.fullmatch(e)) \
            and any(not arch_entry.fullmatch(e) for e in entries):
        return [], False
    flags: list[str] = []
    sm90a = False
    for entry in entries:
        m = arch_entry.fullmatch(entry)
        if m is None:
            sys.exit(f"mpfused: TORCH_CUDA_ARCH_LIST entry {entry!r} is not an arch such as 8.0, 9.0a or 9.0+PTX "
                     f"(the list: {arch_list!r})")
        num = m[1] + m[2]
        target = num + ("a" if num == "90" and sm90a_ok else m[3])
        sm90a = sm90a or target == "90a"
        for flag in (f"-gencode=arch=compute_{target},code=sm_{target}",
                     *([f"-gencode=arch=compute_{num},code=compute_{num}"] if m[4] else [])):
            if flag not in flags:
                flags.append(flag)
    if not flags:
        sys.exit(f"mpfused: TORCH_CUDA_ARCH_LIST names no arch: {arch_list!r}")
    return flags, sm90a


BUILD_CONFIG = {}


class BuildExt(cpp_extension.BuildExtension):
    """Also writes mpfused/_build_config.py next to the built _C (in the source tree for --inplace,
    in build_lib otherwise). mpfused/_ops.py reads it before importing _C, to turn an ABI mismatch with
    the installed torch into a clear error."""

    def run(self):
        super().run()
        target = Path(self.get_ext_fullpath("mpfused._C")).parent / "_build_config.py"
        target.write_text(
            "# Generated by setup.py at build time. Do not edit.\n"
            + "".join(f"{k} = {v!r}\n" for k, v in BUILD_CONFIG.items())
        )
        self.record_cpu_objects()

    def record_cpu_objects(self):
        """Lists the objects of csrc/cpu/*.cpp just built (torch-free code) in build/cpu-objects.txt, for
        `make test-native` to link the native tests against the very objects of the extension instead of
        compiling the CPU kernels a second time. Where they are not all found (another layout of the build
        tree), the file is removed and the native build compiles them itself."""
        listing = ROOT / "build" / "cpu-objects.txt"
        sources = sorted((ROOT / "csrc" / "cpu").glob("*.cpp"))
        objects = [Path(self.build_temp).resolve() / "csrc" / "cpu" / (src.stem + ".o") for src in sources]
        if objects and all(o.is_file() and o.stat().st_mtime >= src.stat().st_mtime for o, src in zip(objects, sources)):
            listing.parent.mkdir(exist_ok=True)
            listing.write_text(";".join(map(str, objects)) + "\n")
        else:
            listing.unlink(missing_ok=True)


def record_build_config(version: str, cuda: bool, arch_list) -> None:
    BUILD_CONFIG.update(VERSION=version, TORCH_VERSION=torch.__version__, CUDA=cuda, CUDA_ARCH_LIST=arch_list)


def make_extension(version: str):
    cuda = use_cuda()
    arch_list = None
    sources = ["csrc/bindings.cpp"] + sorted(
        str(p.relative_to(ROOT)) for d in ("torch", "cpu") for p in (ROOT / "csrc" / d).glob("*.cpp"))
    define = [
        f'-DMPFUSED_VERSION="{version}"',
        f'-DMPFUSED_TORCH_VERSION="{torch.__version__}"',
    ]
    # No -std flag: torch's build helper picks the standard its headers need (C++20 from torch 2.14).
    # The torch-free kernels are C++17 and compile under either.
    # -ffp-contract=off: core/optim/'s explicitly rounded FP32 operations must not be fused into FMAs
    # (the AVX2+FMA code path would otherwise round differently from the CUDA kernels).
    # -fno-math-errno: lets sqrt vectorise; no result changes (only errno is no longer set).
    # -g0 (after Python's own CFLAGS, which carry -g): the debug info of the CPU paths' thousands of
    # instantiations took about 40% of their compile time and 95% of the extension's size.
    # MPFUSED_DEBUG_INFO=1 keeps it (for a debugger; profilers need only the symbols, which stay).
    debug = ["-g"] if os.environ.get("MPFUSED_DEBUG_INFO") == "1" else ["-g0"]
    cxx = ["-O3", *debug, "-ffp-contract=off", "-fno-math-errno", *openmp_flags(), *define]
    ldflags = openmp_flags()
    if not cuda:
        record_build_config(version, False, None)
        return cpp_extension.CppExtension(
            "mpfused._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=ldflags
        )

    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST
    release = nvcc_version(cpp_extension.CUDA_HOME)
    gencode, sm90a = gencode_flags(arch_list, sm90a_ok=int(release.split(".")[0]) >= 12)
    if not gencode:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list  # torch makes the flags from the names
        print(f"mpfused: TORCH_CUDA_ARCH_LIST={arch_list!r} names arches by name: torch's -gencode flags, without "
              "the Hopper GEMM kernel (name 9.0 to have it)")
    sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    cuda_define = ["-DMPFUSED_WITH_CUDA", f'-DMPFUSED_CUDA_ARCH_LIST="{arch_list}"']
    # Our own -gencode flags: torch adds none when the nvcc flags name an arch.
    nvcc = ["-O3", "-lineinfo", "-Xcompiler=-ffp-contract=off", *define, *cuda_define, *gencode]
    if sm90a:
        nvcc.append("-DMPFUSED_HAVE_SM90A=1")
    record_build_config(version, True, arch_list)
    print(f"mpfused: building the CUDA extension for {arch_list} with {cpp_extension.CUDA_HOME}")
    return cpp_extension.CUDAExtension(
        "mpfused._C",
        sources,
        extra_compile_args={"cxx": cxx + cuda_define, "nvcc": nvcc},
        extra_link_args=ldflags,
    )


VERSION = read_version()

setup(
    version=VERSION,
    packages=find_packages(include=["mpfused", "mpfused.*"]),
    ext_modules=[make_extension(VERSION)],
    cmdclass={"build_ext": BuildExt},
    zip_safe=False,
)
