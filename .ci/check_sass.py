#!/usr/bin/env python3
"""SASS and resource check of the compiled CUDA kernels, no GPU needed.

For every kernel and every arch in the binary: registers, shared memory, local memory and stack (from
`cuobjdump -res-usage`), and the machine code itself (`cuobjdump -sass`). Fails when
  - an expected arch has no machine code (SASS) in the binary;
  - a kernel uses local memory or spills (LDL/STL instructions, LOCAL > 0);
  - a kernel lacks an instruction its rule requires (e.g. 128-bit loads in the memory-bound kernels,
    HMMA with FP32 accumulation in the tensor-core GEMM).

cuobjdump and nvdisasm come from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) or the CUDA
toolkit. Usage: check_sass.py LIB.so [--archs 75,80,86,89,90]
With --loops PATTERN it checks nothing and prints the loops of the matching kernels instead (static
instruction counts per loop and their memory accesses), e.g. for the optimizer's stochastic AdamW loops:
  check_sass.py build/cuda-check/libmpfused_cuda_kernels.so --archs 90 --loops 'optim_kernel<AdamPolicy, \(Pass\)0, true>'
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# (kernel-name pattern, what, SASS regex, archs): every listed arch's code of a matching kernel must
# contain the regex. archs: a predicate on the SM number (75, 80, ...).
ALL = lambda sm: True  # noqa: E731
RULES: list[tuple[str, str, str, object]] = [
    (r"overflow_kernel", "128-bit global loads", r"\bLDG\.E\.128\b", ALL),
    (r"optim_kernel", "128-bit global loads", r"\bLDG\.E\.128\b", ALL),
    # Stochastic rounding: eight FP32 values in (two 128-bit loads), eight 16-bit results out (one store).
    (r"round_kernel", "128-bit global loads", r"\bLDG\.E\.128\b", ALL),
    (r"round_kernel", "128-bit global stores", r"\bSTG\.E\.128\b", ALL),
    # Following a write from outside the step: eight 16-bit params (one 128-bit load) beside their masters
    # (two) or remainders (one).
    (r"follow_kernel", "128-bit global loads", r"\bLDG\.E\.128\b", ALL),
    # Fixed point's Convert: the warps' groups take four elements a lane an access (FP32 to FP32: 128-bit
    # loads and stores; four FP16 inputs: one 64-bit load, which the thread-a-Philox-block path never has).
    (r"quantize_kernel<\(FixedType\)2, \(FixedType\)2,", "128-bit global loads", r"\bLDG\.E\.128\b", ALL),
    (r"quantize_kernel<\(FixedType\)2, \(FixedType\)2,", "128-bit global stores", r"\bSTG\.E\.128\b", ALL),
    (r"quantize_kernel<\(FixedType\)4, \(FixedType\)2,", "64-bit loads of four FP16 values", r"\bLDG\.E\.64\b", ALL),
    # The fixed-point MACC of int16 codes: integer MMAs of unsigned 8-bit digits (IMMA.8816.U8.U8 on sm_75,
    # IMMA.16816.U8.U8 on sm_80+), A's fragments by ldmatrix.
    (r"matmul_tc_kernel<", "IMMA of unsigned 8-bit digits", r"\bIMMA\.\d+\.U8\.U8\b", ALL),
    (r"matmul_tc_kernel<", "ldmatrix fragment loads", r"\bLDSM\.", ALL),
    # Tensor-core MMAs that accumulate in FP32 (HMMA.1688.F32 on sm_75, HMMA.16816.F32 on sm_80+).
    (r"gemm_kernel<__half,", "HMMA with F32 accumulation", r"\bHMMA\.\d+\.F32\b", ALL),
    (r"gemm_kernel<__nv_bfloat16,", "HMMA BF16 with F32 accumulation", r"\bHMMA\.\d+\.F32\.BF16\b",
     lambda sm: sm >= 80),
    # BF16 fragments need sm_80: on sm_75 the BF16 kernels are a trap the launcher never reaches.
    (r"gemm_kernel<__nv_bfloat16,", "trap (no BF16 MMA below sm_80)", r"\bBPT\.TRAP\b", lambda sm: sm < 80),
    # The vector path: cp.async (LDGSTS) on sm_80+, 128-bit loads on sm_75.
    (r"gemm_kernel<__half, \w+, \w+, true>", "cp.async 128-bit copies", r"\bLDGSTS\.E\.BYPASS\.128\b",
     lambda sm: sm >= 80),
    (r"gemm_kernel<__nv_bfloat16, \w+, \w+, true>", "cp.async 128-bit copies",
     r"\bLDGSTS\.E\.BYPASS\.128\b", lambda sm: sm >= 80),
    (r"gemm_kernel<__half, \w+, \w+, true>", "128-bit global loads", r"\bLDG\.E\.128\b", lambda sm: sm < 80),
    # The Hopper kernel: warpgroup MMAs (64x256x16, FP32 accumulation) fed by TMA copies (UTMALDG) through
    # mbarriers (SYNCS), its warpgroups' registers moved by setmaxnreg (USETMAXREG), in the sm_90a image; every
    # other arch's image is a trap that the launcher never reaches.
    (r"gemm_sm90_kernel<__half,", "HGMMA 64x256x16 F32", r"\bHGMMA\.64x256x16\.F32\b", lambda sm: sm == 90),
    (r"gemm_sm90_kernel<__nv_bfloat16,", "HGMMA 64x256x16 F32 BF16", r"\bHGMMA\.64x256x16\.F32\.BF16\b",
     lambda sm: sm == 90),
    (r"gemm_sm90_kernel<", "TMA tile copies of 3-D boxes", r"\bUTMALDG\.3D\b", lambda sm: sm == 90),
    (r"gemm_sm90_kernel<", "mbarrier waits", r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b", lambda sm: sm == 90),
    (r"gemm_sm90_kernel<\w+, \w+, \w+, 1>", "mbarrier arrivals (the consumers' releases)",
     r"\bSYNCS\.ARRIVE\.TRANS64\.A1T0\b", lambda sm: sm == 90),
    # In clusters of two CTAs: B's halves multicast to both, releases on both CTAs' mbarriers (remote arrivals), and
    # the cluster barriers at the start and the end.
    (r"gemm_sm90_kernel<\w+, \w+, \w+, 2>", "multicast TMA copies", r"\bUTMALDG\.3D\.MULTICAST\b",
     lambda sm: sm == 90),
    (r"gemm_sm90_kernel<\w+, \w+, \w+, 2>", "remote mbarrier arrivals (the consumers' releases)",
     r"\bSYNCS\.ARRIVE\.TRANS64\.RED\.A1T0\b", lambda sm: sm == 90),
    (r"gemm_sm90_kernel<\w+, \w+, \w+, 2>", "cluster barrier", r"\bUCGABAR_WAIT\b", lambda sm: sm == 90),
    (r"gemm_sm90_kernel<", "setmaxnreg", r"\bUSETMAXREG\b", lambda sm: sm == 90),
    (r"gemm_sm90_kernel<", "trap (wgmma needs sm_90a)", r"\bBPT\.TRAP\b", lambda sm: sm != 90),
]
DEFAULT_ARCHS = "75,80,86,89,90"


@dataclass
class Kernel:
    arch: str
    name: str
    regs: int = 0
    shared: int = 0
    local: int = 0
    stack: int = 0
    sass: list[str] = field(default_factory=list)


def find_tool(name: str) -> str:
    candidates = [shutil.which(name)]
    for base in {sys.prefix, os.path.dirname(os.path.dirname(sys.executable))}:
        candidates += [str(p) for p in Path(base).glob(f"lib/python3*/site-packages/nvidia/*/bin/{name}")]
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates.append(os.path.join(cuda_home, "bin", name))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    sys.exit(f"check_sass: {name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def run(cmd: list[str], env: dict) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        sys.exit(f"check_sass: {' '.join(cmd)} failed:\n{out.stderr}")
    return out.stdout


def demangle(names: list[str]) -> dict[str, str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def short(name: str) -> str:
    name = re.sub(r"\(anonymous namespace\)::|mpf::", "", name)
    if name.endswith(")"):  # drop the parameter list: the parenthesis group that closes the name
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                return name[:i]
    return name


def parse(lib: str, cuobjdump: str, env: dict) -> dict[tuple[str, str], Kernel]:
    kernels: dict[tuple[str, str], Kernel] = {}
    arch = None
    current = None
    for line in run([cuobjdump, "-res-usage", "-elf", lib], env).splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            current = m.group(1)
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and current and arch:
            k = kernels.setdefault((arch, current), Kernel(arch, current))
            k.regs, k.stack, k.shared, k.local = map(int, m.groups())
    arch = None
    for line in run([cuobjdump, "-sass", lib], env).splitlines():
        m = re.match(r"\s*arch = sm_(\d+)", line)
        if m:
            arch = m.group(1)
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            kernels.setdefault((arch, current), Kernel(arch, current))
            continue
        if current and arch and re.match(r"\s*/\*[0-9a-f]{4,}\*/", line):
            kernels[(arch, current)].sass.append(line)
    return kernels


def loops(sass: list[str]) -> list[tuple[int, int, list[str]]]:
    """The loops of a kernel's SASS: for each backward branch, (start address, branch address, the body's
    instructions without predicates), innermost and outermost alike."""
    ins = []
    for line in sass:
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2))))
    at = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.match(r"BRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in at:
            out.append((int(m.group(1), 16), a, [t for _, t in ins[at[int(m.group(1), 16)]:i + 1]]))
    return out


def report_loops(libs: list[str], pattern: str, archs: str, cuobjdump: str, env: dict, least: int) -> int:
    """Prints the loops of the kernels whose name matches `pattern` (static instruction counts: the figures
    README quotes for the optimizer's loops), with their global and shared memory accesses."""
    for lib in libs:
        kernels = parse(lib, cuobjdump, env)
        names = demangle(sorted({k.name for k in kernels.values()}))
        for (arch, _), k in sorted(kernels.items()):
            name = short(names[k.name])
            if arch not in {a.strip() for a in archs.split(",")} or not re.search(pattern, name):
                continue
            found = [lp for lp in loops(k.sass) if len(lp[2]) >= least]
            print(f"sm_{arch} {name}: {k.regs} registers, {len(k.sass)} instructions, {len(found)} loops of {least}+")
            for start, end, body in sorted(found, key=lambda lp: -len(lp[2])):
                ops = {}
                for t in body:
                    op = t.split()[0]
                    if op.split(".")[0] in ("LDG", "STG", "LDS", "STS", "LD", "ST"):
                        ops[op] = ops.get(op, 0) + 1
                mem = ", ".join(f"{o} {n}" for o, n in sorted(ops.items()))
                print(f"  {start:#07x}-{end:#07x}: {len(body)} instructions; {mem}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libs", nargs="+")
    ap.add_argument("--archs", default=DEFAULT_ARCHS, help="comma-separated SM versions that must have SASS")
    ap.add_argument("--loops", metavar="PATTERN", help="instead of the check: the loops of the kernels whose "
                    "name matches PATTERN (e.g. 'optim_kernel<AdamPolicy, \\(Pass\\)0, true>' with --archs 90)")
    ap.add_argument("--least", type=int, default=200, help="with --loops: loops of at least this many instructions")
    args = ap.parse_args()
    cuobjdump = find_tool("cuobjdump")
    nvdisasm = find_tool("nvdisasm")
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    if args.loops:
        return report_loops(args.libs, args.loops, args.archs, cuobjdump, env, args.least)

    errors: list[str] = []
    rows = []
    for lib in args.libs:
        kernels = parse(lib, cuobjdump, env)
        names = demangle(sorted({k.name for k in kernels.values()}))
        found_archs = {k.arch for k in kernels.values() if k.sass}
        for a in args.archs.split(","):
            if a.strip() not in found_archs:
                errors.append(f"{lib}: no SASS for sm_{a.strip()}")
        for (arch, _), k in sorted(kernels.items()):
            name = short(names[k.name])
            local_ops = sum(1 for ln in k.sass if re.search(r"\b(LDL|STL)\b", ln))
            status = []
            if k.local or local_ops:
                errors.append(f"sm_{arch} {name}: local memory {k.local} B, {local_ops} LDL/STL (spills)")
                status.append("SPILLS")
            for pattern, what, sass_re, archs in RULES:
                if (re.search(pattern, k.name) or re.search(pattern, name)) and archs(int(arch)):
                    if not any(re.search(sass_re, ln) for ln in k.sass):
                        errors.append(f"sm_{arch} {name}: no {what} ({sass_re})")
                        status.append(f"NO {what}")
                    else:
                        status.append(what)
            rows.append((f"sm_{arch}", name, k.regs, k.shared, k.local, k.stack, len(k.sass), ", ".join(status) or "-"))

    header = ("arch", "kernel", "regs", "smem", "local", "stack", "instrs", "checks")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))
    if not rows:
        errors.append("no kernels found")
    if errors:
        print("\nSASS check FAILED:")
        for e in errors:
            print("  " + e)
        return 1
    print(f"\nSASS check passed: {len(rows)} kernel/arch pairs, no spills, every rule satisfied.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
